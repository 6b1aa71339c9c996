"""Restart-based strategies: checkpoint-and-restart (Young/Daly interval) and in-memory restart.

Owns: what a restart costs and what it loses. Any fault that touches the job stops every process; the
job relaunches (detect + restart + reload) on the replica groups available then, with the same global
batch (gradient accumulation over fewer groups, so the trajectory does not drift; only time is lost).
Checkpoint-and-restart rolls back to its last persistent checkpoint; in-memory restart snapshots every
step into CPU memory (erasure-coded across nodes, so one node's loss is covered) and loses only the step
in flight. Replaced hardware joins at the next restart. Does not own: the shared bookkeeping (base.py).
"""
from __future__ import annotations

import math
from typing import Any

from unbroken.sim.cluster import Fault
from unbroken.sim.strategies.base import Run


def young_daly(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Daly's optimum checkpoint interval (compute time between checkpoints), s.

    Daly 2006, first-order-corrected: sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + d / 18M) - d for d < 2M,
    else M, with d the blocking checkpoint cost and M the mean time between failures (both s). Young's
    1974 sqrt(2 d M) is its leading term. (Belongs in unbroken.policy.snapshotting once that exists.)
    """
    d, m = checkpoint_seconds, mtbf_seconds
    if m == math.inf:
        return math.inf
    if d <= 0:
        return 0.0
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


def interval_steps(checkpoint_seconds: float, mtbf_seconds: float, step_seconds: float) -> int:
    """The Young/Daly interval in whole steps (>= 1); 0 when no failure is expected."""
    tau = young_daly(checkpoint_seconds, mtbf_seconds)
    if tau == math.inf:
        return 0
    return max(1, round(tau / step_seconds))


def trace_mtbf(run: Run) -> float:
    """Mean time between interrupting faults that the operator plans for, s: the random causes' rate
    plus the traced events spread over the run (an operator would use last run's count)."""
    rate = run.sc.failure_rate() + sum(1 for e in run.sc.trace if e.scope != "slow") / run.horizon
    return 1.0 / rate if rate > 0 else math.inf


class CheckpointRestart(Run):
    name = "checkpoint_restart"
    rolls_back = True

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.ckpt_cost = self.costs.checkpoint_seconds
        self.mtbf = trace_mtbf(self)
        self.ckpt_every = interval_steps(self.ckpt_cost, self.mtbf, self.t_full)

    def describe(self) -> dict[str, Any]:
        return {"mtbf_seconds": round(self.mtbf, 3), "checkpoint_interval_seconds":
                round(self.ckpt_every * self.t_full, 3)}

    def reload_seconds(self) -> float:
        return self.costs.reload_seconds

    def interrupt(self, t: float, f: Fault) -> None:
        if f.scope != "software" and not set(f.replicas) & set(self.members) and self.seg is not None:
            self.mark_out(t, f, self.costs.replace_seconds)  # hardware the job does not use right now
            return
        self.stop(t, f.cause, None)
        if self.rolls_back:
            self.rollback(t, f.cause)
        if f.scope != "software":
            for r in self.mark_out(t, f, self.costs.replace_seconds):
                self.log.emit("member_dead", t, replica=r, epoch=self.epoch + 1, reason=f.cause)
        down = self.costs.detect_seconds + self.costs.restart_seconds + self.reload_seconds()
        self.log.emit("restart", t, seconds=round(down, 6), reason=f.cause, members=len(self.available()))
        self.busy_until = t + down
        self.engine.at(self.busy_until, "resume")


class InMemoryRestart(CheckpointRestart):
    name = "in_memory_restart"
    rolls_back = False

    def __init__(self, *a: Any, **kw: Any):
        Run.__init__(self, *a, **kw)
        self.snapshot = self.costs.snapshot_seconds

    def describe(self) -> dict[str, Any]:
        return {"snapshot_every_steps": 1}

    def reload_seconds(self) -> float:
        return self.costs.memory_restore_seconds
