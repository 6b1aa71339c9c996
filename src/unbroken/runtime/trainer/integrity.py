"""A rank's silent-corruption duties in the step, behind one face the trainer calls at fixed points.

Owns: wiring the injected flips (bitflip.py), microbatch recomputation (recompute.py), the finite check
and the state agreement check (agreement.py) to the points of the step where each belongs, and the
bookkeeping between those points (the step's recomputation plan, the digests of our checked microbatches).
Does not own: any of those mechanisms, the step protocol (step.py), or decisions (policy.corruption).

The trainer calls, per step: `begin` after the step's state machine starts (its owners and members),
`start` before its compute, `before`/`after` around each own microbatch's backward, `finish` after its
last one and `finite` before anything computed is reduced; `after_apply` right after the optimizer step
of a committed step, before its digest: it returns whether our state was replaced (the step computing
since must be redone).
"""
from __future__ import annotations

import torch

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.model.data import mix, seed_microbatch
from unbroken.policy.workload import loss_weight
from unbroken.runtime.trainer.agreement import StateCheck, check_finite
from unbroken.runtime.trainer.bitflip import Flipper
from unbroken.runtime.trainer.membership import Coordination
from unbroken.runtime.trainer.recompute import Recompute
from unbroken.runtime.trainer.stepwork import model_inputs


class Integrity:
    """Build once per rank, after its parameters, optimizer and donor exist. `plain`: a one-rank replica
    group that computes whole microbatches (recompute.py's scope)."""

    def __init__(self, cfg: Config, coord: Coordination, log: EventLog, me: int, rank: int, parts, params: list,
                 flips: tuple, holds: tuple[int, ...], shard, tag, plain: bool, device: torch.device):
        d, self.cfg, self.parts, self.device = cfg.detect, cfg, parts, device
        self.flipper = Flipper(flips, me, rank, log, params)  # its hooks first: digests see its flips
        self.check = StateCheck(coord, log, me, rank, holds, parts.model, parts.optimizer, d.state_every,
                                cfg.coord.collective_timeout, shard, tag, d.evict_after)
        self.recompute = Recompute(coord, log, me, params, d.recompute_fraction if plain else 0.0, cfg.run.seed,
                                   cfg.coord.collective_timeout)
        self.coord, self.log, self.me, self.tag = coord, log, me, {"rank": rank} if rank else {}
        self._plan: tuple | None = None  # (epoch, owners, members, ours checked, ones we check)
        self._digests: dict[int, str] = {}
        self._current: tuple | None = None  # the plan of the step computing now (start .. finish)

    def begin(self, step: int, epoch: int, owners: tuple[int, ...], members: tuple[int, ...]) -> None:
        self._plan = (epoch, owners, members, *self.recompute.plan(step, owners, members))

    def start(self, step: int, work, restore) -> None:
        """Before the step's first compute: the microbatches we check for others, computed and dropped
        (`restore()` re-points `.grad` at the accumulator). A retry's compute finds no plan: nothing."""
        self._digests, self._current = {}, self._plan
        self._plan = None
        if self._current:  # our digests of theirs are voted on with ours at `finish`
            self._digests = self.recompute.check_others(step, self._current[4], lambda s, i: self._loss(work, s, i),
                                                        restore)

    def before(self, step: int, i: int, first: bool) -> None:
        self.flipper.arm(step, i, first)
        if self._current and i in self._current[3]:
            self.recompute.capture()

    def after(self, step: int, i: int) -> None:
        self.flipper.disarm()
        if self._current and i in self._current[3]:
            self.recompute.publish(step, i, digest := self.recompute.captured())
            self._digests[i] = digest

    def finish(self, step: int) -> None:
        """After our last microbatch: the votes on the checked ones we own or check (outvoted: we leave)."""
        if self._digests:
            epoch, owners, members, _, _ = self._current
            self.recompute.verify(step, epoch, owners, members, self._digests)
        self._current, self._digests = None, {}

    def finite(self, work, step: int, microbatches: tuple[int, ...]) -> None:
        if self.cfg.detect.finite_check:  # non-finite: this process leaves and never returns
            check_finite(work.acc.buffers, step, microbatches, self.coord, self.log, self.me, self.tag)

    def after_apply(self, step: int, epoch: int, members: tuple[int, ...]) -> bool:
        self.flipper.flip_state(step, self.parts.optimizer)  # a flip fault's parameter or optimizer state
        return self.check.due(step) and self.check.run(step, epoch, members)

    def _loss(self, work, step: int, i: int) -> torch.Tensor:
        """Microbatch i's weighted loss on a one-rank replica, seeded as the trainer's compute seeds it."""
        mb = self.parts.data.microbatch(step, i)
        seed_microbatch(mix(self.cfg.run.seed, step, i))
        return self.parts.model(mb.x.to(self.device), mb.y.to(self.device),
                                **model_inputs(mb, self.parts.inputs, self.device)) * loss_weight(mb.tokens,
                                                                                                   work.tokens)
