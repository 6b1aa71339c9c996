"""Microbatch recomputation: a chosen microbatch's gradient computed by two more replicas and compared
before the step's commit; an owner outvoted leaves the step, so the majority's gradient is reduced.

Owns: for each microbatch `policy.corruption.recomputed` names in a step (a pure draw of the step: every
member agrees), the owner's digest of that microbatch's gradient as its backward produces it (tensor
hooks on every parameter, after any injected flip, before any accumulator sees it), the two checkers'
standalone forward/backward of it (policy.corruption.checkers: gradients taken and dropped, the
accumulator untouched), their digests in the store (`gradcheck/{s}/{i}/{g}`), and each participant's
vote over the three before anything of its step is reduced. An owner outvoted writes a `corruption`
event (kind "gradient") and leaves the run as a failed group does: its microbatches are recomputed by
the others in the step's retry, so the step commits the majority's gradients and stays on the
failure-free trajectory. A checker outvoted leaves the same way (its own microbatches are not trusted).
Does not own: the draw, the checkers or the vote (policy), the trainer's compute (integrity.py calls
`plan`, `check_others`, `capture`/`captured`/`publish`, `verify`).

Scope: one-rank replica groups (a group of several ranks computes a microbatch through its collectives:
not recomputed), first attempts of a step (a retry's redone microbatches are not). Bitwise agreement
needs `--exact` (one thread, deterministic kernels): without it a mismatch may be rounding.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import xxhash

from unbroken.events import EventLog
from unbroken.policy.corruption import checkers, recomputed, vote
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination


class Recompute:
    """Build once per rank (after the Flipper, whose hooks must run first). `compute(step, i)`: one
    microbatch's weighted loss of `step` on this replica's model (the trainer's forward, seeded)."""

    def __init__(self, coord: Coordination, log: EventLog, me: int, params: list[torch.Tensor],
                 fraction: float, seed: int, timeout_s: float):
        self.coord, self.log, self.me, self.params = coord, log, me, params
        self.fraction, self.seed, self.timeout_s = fraction, seed, timeout_s
        self._grads: dict[int, str] | None = None  # parameter index -> digest of this backward's gradient
        if fraction > 0:
            for k, p in enumerate(params):
                p.register_hook(lambda g, k=k: self._take(k, g))

    def _take(self, k: int, g: torch.Tensor) -> None:
        if self._grads is not None:
            self._grads[k] = xxhash.xxh3_128_hexdigest(g.detach().to("cpu", torch.float32).contiguous().numpy())

    def plan(self, step: int, owners: tuple[int, ...], members: tuple[int, ...]) -> tuple[set[int], list[int]]:
        """(the microbatches this replica owns that are checked, those it checks for others) in `step`."""
        chosen = recomputed(step, len(owners), self.fraction, self.seed) if self.fraction > 0 else ()
        mine = {i for i in chosen if owners[i] == self.me and len(members) > 1}
        others = [i for i in chosen if self.me in checkers(owners[i], members, i)]
        return mine, others

    def capture(self) -> None:
        """Before a checked microbatch's backward: digest each parameter's gradient as it arrives."""
        self._grads = {}

    def captured(self) -> str:
        """After it: the microbatch's gradient digest (the parameters' in order)."""
        grads, self._grads = self._grads or {}, None
        return xxhash.xxh3_128_hexdigest("".join(grads.get(k, "-") for k in range(len(self.params))).encode())

    def publish(self, step: int, i: int, digest: str) -> None:
        self.coord.store.set(keys.grad_check(step, i, self.me), digest)

    def check_others(self, step: int, others: list[int], compute: Callable[[int, int], torch.Tensor],
                     restore: Callable[[], None]) -> dict[int, str]:
        """Compute each microbatch of `others` standalone, publish its gradient digest, drop the gradients;
        `restore()` points `.grad` back at the accumulator after. Returns {microbatch: our digest}."""
        if not others:
            return {}
        ours = {}
        for p in self.params:
            p.grad = None
        for i in others:
            loss = compute(step, i)
            self.capture()
            loss.backward()
            self.publish(step, i, digest := self.captured())
            ours[i] = digest
            for p in self.params:
                p.grad = None
        restore()
        return ours

    def verify(self, step: int, epoch: int, owners: tuple[int, ...], members: tuple[int, ...],
               mine: dict[int, str]) -> None:
        """Call once this replica's microbatches of `step` are computed, before any of it is reduced:
        `mine` our digests of the checked microbatches we own or check. Each is voted on with the other
        two replicas' (the owner writes the event of a mismatch; a checker, only where it is the one
        outvoted). Outvoted, owner or checker, this process leaves (exit 4) and never returns: a device
        that computed one microbatch wrong is not trusted with the others it summed."""
        for i, digest in sorted(mine.items()):
            peers = tuple(g for g in (owners[i], *checkers(owners[i], members, i)) if g != self.me)
            got = self._gather(step, epoch, i, peers)
            if got is None:
                self.log.emit("gradient_check", step=step, replica=self.me, microbatch=i, ok=None,
                              why="a checker is gone")
                continue
            digests = {self.me: digest, **got}
            verdict = vote(digests)
            if (not verdict.wrong and not verdict.split) or (owners[i] != self.me and self.me not in verdict.wrong):
                continue
            self.log.emit("corruption", kind="gradient", step=step, replica=self.me, microbatch=i,
                          owner=owners[i], wrong=list(verdict.wrong), digests=digests, split=verdict.split,
                          **({"found": digest, "agreed": verdict.agreed} if self.me in verdict.wrong else {}))
            if self.me in verdict.wrong:  # our sum holds a wrong gradient: the others redo our microbatches
                self.coord.store.add(keys.suspect(self.me, 0), 1)
                self.coord.leave("gradient outvoted: device suspect")
                os._exit(4)

    def _gather(self, step: int, epoch: int, i: int, peers: tuple[int, ...]) -> dict[int, str] | None:
        names = {g: keys.grad_check(step, i, g) for g in peers}
        deadline = time.monotonic() + self.timeout_s
        while not self.coord.store.check(list(names.values())):
            if self.coord.moved(epoch) or time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        return {g: v.decode() for g, v in zip(names, self.coord.store.multi_get(list(names.values())))}
