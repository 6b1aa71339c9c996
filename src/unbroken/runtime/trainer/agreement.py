"""The state agreement check: replicas that must hold the same state, compared, and the wrong one healed.

Owns: after a committed step that `policy.corruption.state_check_due` names, publishing this rank's digest
of each shard index it holds (parameters and optimizer state, XXH3-128) under the step, reading every
member's, the vote (policy.corruption.vote: every member computes the same verdict from the same digests,
so no decision is written), and the heal it implies: the wrong group's rank j pulls the state of the
majority's lowest group's rank j over a two-rank gloo group (persist/healing.py: the joiner's transfer,
its digest checked), in place, with no restart; the `corruption` and `heal` events; the suspect counter
of the wrong rank in the store. Does not own: when a step commits or what the digest covers
(persist/healing.state_tensors: what a joiner receives), evicting a suspect (the coordinator).

Why after the commit and not inside the step: the check reads state every member has once the step is
applied, at a boundary where every member is anyway (the commit); a corruption that lands in the state
between two checks is found at the next, at most `detect.state_every` steps later, and meanwhile the
wrong group's gradients reach every group's reduction (docs/corruption.md: how far it travels).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import xxhash

from unbroken.events import EventLog
from unbroken.policy.corruption import Suspects, state_check_due, vote
from unbroken.runtime.persist.healing import Forming, Shard, donate, receive, state_tensors
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination


def state_digest(tensors: list[torch.Tensor]) -> str:
    """XXH3-128 (hex) of `tensors`' bytes in order (parameters, then their optimizer state: what a heal
    sends), each as float32 on the host."""
    h = xxhash.xxh3_128()
    for t in tensors:  # a float32 contiguous host tensor is hashed in place (its numpy view: no copy)
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())
    return h.hexdigest()


def check_finite(buffers: list[torch.Tensor], step: int, microbatches: tuple[int, ...], coord: Coordination,
                 log: EventLog, me: int, tag: dict) -> None:
    """After computing `microbatches` of `step` into the accumulator (`buffers`: its flat sums, the
    weighted loss last), before any of it is reduced: where a value is NaN or inf, this group leaves the
    run at once (a `nonfinite` event naming it, the microbatches and the step; exit 4), as a failed one
    does: the step is retried without it, its microbatches recomputed by the others, so no non-finite
    value is committed; a restarted group heals from a peer. One float64 sum a buffer: non-finite iff an
    element is (float64 does not overflow on float32 gradients). A non-finite value that is the data's
    reappears on whoever recomputes it: each leaves in turn (docs/corruption.md: not yet told apart)."""
    bad = [b for b in buffers if not bool(torch.isfinite(b.sum(dtype=torch.float64)))]
    if not bad:
        return
    log.emit("nonfinite", step=step, replica=me, microbatches=list(microbatches),
             loss=repr(float(bad[-1][-1])), **tag)
    coord.leave("non-finite gradient or loss: device suspect")
    os._exit(4)


class StateCheck:
    """Build once per rank. `holds`: the shard indices this rank holds; `shard(j)`: the state of index
    j when it holds several (None: all of the model's); `tag(j)`: the event tag of index j; `every`:
    detect.state_every; `evict_after`: detect.evict_after; `timeout_s`: the longest a member waits for a
    peer's digest before it skips the check (a peer that died in between is declared dead sooner).

    Every member counts every verdict (policy.corruption.Suspects), so all agree, without a word in the
    store, on the check at which a device is found wrong for the `evict_after`-th time: that one is not
    healed but leaves the run (exit 4), as a lost group does; the coordinator re-plans without it."""

    def __init__(self, coord: Coordination, log: EventLog, me: int, rank: int, holds: tuple[int, ...],
                 model: nn.Module, optimizer: torch.optim.Optimizer, every: int, timeout_s: float,
                 shard: Callable[[int], Shard] | None, tag: Callable[[int], dict], evict_after: int = 0):
        self.coord, self.log, self.me, self.rank, self.holds = coord, log, me, rank, holds
        self.model, self.optimizer, self.every, self.timeout_s = model, optimizer, every, timeout_s
        self.shard, self.tag, self.evict_after = shard, tag, evict_after
        self.suspects = Suspects()

    def due(self, step: int) -> bool:
        return state_check_due(step, self.every)

    def run(self, step: int, epoch: int, members: tuple[int, ...]) -> bool:
        """Call right after applying `step` (of `members`, in `epoch`), where `due(step)`, before anything
        reads the state: publish, compare, heal. Every member calls it at the same step. Returns whether
        this rank's state was replaced (its work computed since on the old state must be redone)."""
        mine = {j: state_digest(self._state(j)) for j in self.holds}
        for j, digest in mine.items():
            self.coord.store.set(keys.state_check(step, self.me, j), digest)
        healed = False
        for j in self.holds:
            digests = self._gather(step, epoch, members, j)
            if digests is None:
                self.log.emit("state_check", step=step, replica=self.me, ok=None, why="a member is gone",
                              **self.tag(j))
                continue
            verdict = vote(digests)
            if not verdict.wrong and not verdict.split:
                continue
            if verdict.split:  # seen, but no majority says who is wrong: nobody is healed
                self.log.emit("corruption", step=step, replica=self.me, groups=sorted(digests),
                              digests=digests, healed=False, why="no majority", **self.tag(j))
                continue
            evicted = set()
            for g in verdict.wrong:
                self.suspects, evict = self.suspects.found(f"group {g} rank {j}", self.evict_after)
                if evict:
                    evicted.add(g)
            healed |= self._heal(step, j, verdict.donor, verdict.wrong, digests, verdict.agreed, evicted)
        return healed

    def _state(self, j: int) -> list[torch.Tensor]:
        """Shard index j's parameters and optimizer state, as a heal sends them."""
        return self.shard(j)()[1] if self.shard else state_tensors(self.model, self.optimizer)

    def _gather(self, step: int, epoch: int, members: tuple[int, ...], j: int) -> dict[int, str] | None:
        """Every member's digest of shard j after `step`; None once the membership moved past `epoch` (a
        member lost) or `timeout_s` passed."""
        names = {g: keys.state_check(step, g, j) for g in members}
        deadline = time.monotonic() + self.timeout_s
        while not self.coord.store.check(list(names.values())):
            if self.coord.moved(epoch) or time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        values = self.coord.store.multi_get(list(names.values()))
        return {g: v.decode() for g, v in zip(names, values)}

    def _heal(self, step: int, j: int, donor: int, wrong: tuple[int, ...], digests: dict[int, str],
              agreed: str, evicted: set[int]) -> bool:
        """The donor's rank j sends its state to each wrong group's rank j; a wrong rank receives it, or
        leaves the run where it is `evicted`."""
        t = time.perf_counter()
        if self.me in wrong:
            found = self.coord.store.add(keys.suspect(self.me, j), 1)
            self.log.emit("corruption", step=step, replica=self.me, donor=donor, found=digests[self.me],
                          agreed=agreed, groups=len(digests), times=found, **self.tag(j))
            if self.me in evicted:
                self.log.emit("evicted", step=step, replica=self.me, why="corrupted", times=found, **self.tag(j))
                self.coord.leave(f"evicted: state corrupted {found} times")
                os._exit(4)
            forming = Forming(self.coord.group_store(), keys.state_heal_prefix(step, self.me, j), 1, self.timeout_s)
            got, seconds, transfer = receive(forming, self.model, self.optimizer, self.shard(j) if self.shard else None)
            after = state_digest(self._state(j))
            self.log.emit("heal", replica=self.me, donor=donor, step=step, bytes=got, seconds=round(seconds, 6),
                          transfer=round(transfer, 6), side="joiner", why="corruption", digest_ok=after == agreed,
                          **self.tag(j))
            if after != agreed:
                raise RuntimeError(f"healed state of replica {self.me} shard {j} hashes to {after}, the "
                                   f"majority's to {agreed}")
            return True
        if self.me == donor:
            for g in (g for g in wrong if g not in evicted):
                forming = Forming(self.coord.group_store(), keys.state_heal_prefix(step, g, j), 0, self.timeout_s)
                sent, seconds, transfer = donate(forming, self.model, self.optimizer,
                                                 self.shard(j) if self.shard else None,
                                                 lambda g=g: self.coord.is_dead(g))
                self.log.emit("heal", replica=g, donor=self.me, step=step, bytes=sent, seconds=round(seconds, 6),
                              transfer=round(transfer, 6), side="donor", why="corruption",
                              held=round(time.perf_counter() - t, 6), **self.tag(j))
        return False
