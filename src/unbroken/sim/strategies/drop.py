"""Drop-replica with a shrinking batch (torchft-like).

Owns: what happens when a replica group dies and the others go on without it: the survivors detect the
loss, re-form, discard the step in flight and go on, each still computing its own share (M / R
microbatches), so the global batch shrinks to the survivors' shares and the step time stays put. A
replaced group heals from a live peer and rejoins at a step boundary after a re-form stall. A software
failure takes every process; with no live peer left, the job restarts from its last persistent
checkpoint, taken at the Young/Daly interval for the software failure rate. Does not own: the shared
bookkeeping (base.py).
"""
from __future__ import annotations

import math
from typing import Any

from unbroken.sim.cluster import Fault
from unbroken.sim.strategies.base import Run
from unbroken.sim.strategies.restart import interval_steps


class DropReplica(Run):
    name = "drop_replica"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        rate = self.sc.failure_rate(("software",)) + \
            sum(1 for e in self.sc.trace if e.scope == "software") / self.horizon
        self.ckpt_cost = self.costs.checkpoint_seconds
        self.ckpt_every = interval_steps(self.ckpt_cost, 1 / rate if rate else math.inf, self.t_full)

    def plan(self, members: tuple[int, ...]) -> tuple[float, int]:
        """Every member computes its failure-free share; the batch is what the members hold."""
        w = self.sc.workload
        base = max(self.full_quotas[r] * w.microbatch_seconds * self.slowdown(r) for r in members)
        return base + w.sync_seconds, sum(self.full_quotas[r] for r in members)

    def interrupt(self, t: float, f: Fault) -> None:
        c = self.costs
        if f.scope == "software":
            self.stop(t, f.cause, c.detect_seconds + c.restart_seconds + c.reload_seconds)
            self.rollback(t, f.cause)
            self.log.emit("restart", t, seconds=c.detect_seconds + c.restart_seconds + c.reload_seconds,
                          reason=f.cause, members=len(self.available()))
            return
        hit = [r for r in f.replicas if r in self.members and r not in self.out]
        self.mark_out(t, f, c.replace_seconds + c.rejoin_seconds)
        if not hit or self.seg is None:
            return
        self.stop(t, f.cause, c.detect_seconds + c.reform_seconds)
        for r in hit:
            self.log.emit("member_dead", t, replica=r, epoch=self.epoch + 1, reason=f.cause)

    def on_back(self, t: float, replica: int) -> None:
        if self.seg is None:
            super().on_back(t, replica)
        else:
            self.replan(t, self.costs.reform_seconds, "rejoin")
