"""A member's side of healing joiners: which joiners its ranks donate to, their heal groups, the transfer.

Owns: at a step boundary, sending this rank's state (each shard index it holds) to the joiner's rank of
the same index, for every group the next step's plan admits and the policy gives to us
(policy.membership.donor); and forming those heal groups ahead of the boundary, as soon as an epoch
admits the joiner. Does not own: the transfer's format and the joiner's side (healing.py), who donates
(policy), or when the boundary is (trainer/step.py: `prepare` when it sees the epoch move, `heal` after
applying a step).

Why form ahead: the donor holds its next step up by the heal, and the two-rank gloo group's rendezvous
was most of that hold (3 groups x 2 ranks on 2 cores, formed at the boundary: 10-233 ms held of a
~140 ms step, the transfer of 0.72 MB 1-3 ms); the joiner forms its side as soon as it is admitted
(healing.Forming), so ours, started when we see the admission, is often ready by the boundary (formed
ahead: 4-256 ms held; under that contention the rendezvous can take longer than the rest of the step).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn

from unbroken.events import EventLog
from unbroken.policy.membership import donor
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination, Plan
from unbroken.runtime.persist.healing import Forming, Shard, donate


class Donor:
    """Build once per rank. `holds`: the shard indices this rank holds (its own; all of them for a
    stand-in); `shard(j)`: the tensors of index j when it holds several (None: all of the model's);
    `tag(j)`: the event tag of index j."""

    def __init__(self, coord: Coordination, log: EventLog, me: int, rank: int, holds: tuple[int, ...],
                 model: nn.Module, optimizer: torch.optim.Optimizer, timeout_s: float,
                 shard: Callable[[int], Shard] | None, tag: Callable[[int], dict]):
        self.coord, self.log, self.me, self.rank, self.holds = coord, log, me, rank, holds
        self.model, self.optimizer, self.timeout_s, self.shard, self.tag = model, optimizer, timeout_s, shard, tag
        self._forming: dict[tuple[int, int, int], Forming] = {}  # (joiner, admitted in, shard) -> its group
        self._members: tuple[int, ...] | None = None  # of the step applied last: who holds the state

    def prepare(self, latest: int) -> None:
        """Call once each time the epoch is seen to move, with the latest epoch: starts forming the heal
        groups of every group it admits that we will most likely donate to, given the members of the
        step we applied last (none applied yet: nothing; the heal then forms its group at the boundary)."""
        members = self._members
        if members is None:
            return
        for g in self.coord.members(latest):
            if g in members or donor(members, g) != self.me or not self.coord.was_admitted(g):
                continue
            admitted = self.coord.admission(g)
            for j in self.holds:
                if (g, admitted, j) not in self._forming:
                    self._forming[(g, admitted, j)] = self._form(g, admitted, j)

    def heal(self, step: int, members: tuple[int, ...], plan: Plan) -> None:
        """Call right after applying `step` (of `members`), whose commit carries `plan`, the next step's:
        each group `plan` admits and the policy gives to us gets this rank's state of `step`, holding our
        next step up by the transfer. A joiner that never comes, or dies mid-transfer, costs us until
        we learn it is gone (or the collective timeout), then it is declared dead and we go on."""
        self._members = members
        for g in (g for g in plan.members if g not in members and donor(members, g) == self.me):
            admitted = self.coord.admission(g)

            def gone(g: int = g, admitted: int = admitted) -> bool:  # lost, a newer incarnation, a sibling gave up
                return (self.coord.is_dead(g) or self.coord.admission(g) != admitted
                        or self.coord.heal_failed(g, admitted))
            t = time.perf_counter()
            if self.rank == 0:
                self.coord.offer_heal(g, admitted, step, plan)
            for j in self.holds:  # a stand-in sends each shard index to the joiner's rank of that index
                ahead = self._forming.pop((g, admitted, j), None)
                forming = ahead or self._form(g, admitted, j)
                try:
                    sent, seconds, transfer = donate(forming, self.model, self.optimizer,
                                                     self.shard(j) if self.shard else None, gone)
                except RuntimeError as e:
                    self.log.emit("heal_failed", replica=g, donor=self.me, step=step, error=str(e)[:200], **self.tag(j))
                    self.coord.heal_failed(g, admitted, now=True)  # our other ranks stop waiting for it too
                    break
                self.log.emit("heal", replica=g, donor=self.me, step=step, bytes=sent, seconds=round(seconds, 6),
                              transfer=round(transfer, 6), side="donor", held=round(time.perf_counter() - t, 6),
                              formed_ahead=ahead is not None, **self.tag(j))
        # a group that took part in a step needs no heal from us: drop what was formed ahead for it
        # (another donor was chosen): its thread ends at its timeout, unused
        self._forming = {k: f for k, f in self._forming.items() if k[0] not in members}

    def _form(self, g: int, admitted: int, j: int) -> Forming:
        return Forming(self.coord.group_store(), keys.heal_prefix(g, admitted, self.me, j), 0, self.timeout_s)
