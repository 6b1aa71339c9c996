"""What every simulated strategy shares: the run's state, closed-form progress, logging and the loss ledger.

Owns: committing the steps of a failure-free stretch (Segment) in one go, stopping and restarting
training, deferring faults that land inside a transition, membership epochs, rollback, and the ledger of
GPU-seconds: every second of every GPU of the cluster is either useful (the failure-free cost of the
tokens finally committed) or lost to one named cause. Does not own: how a strategy reacts to a fault
(subclasses implement `interrupt`, `plan`, and optionally `on_back` / `on_slow`).

Simplifications, all stated in the run_start record: a fault that lands while the job is inside a
transition (restart, in-step recovery, rejoin stall) takes effect when the transition ends; a change
that is not a fault (a slow episode, a rejoin, new quota weights) takes effect at the next step boundary.
"""
from __future__ import annotations

import abc
from collections import defaultdict
from typing import Any

from unbroken.policy import workload
from unbroken.policy.membership import Membership
from unbroken.sim.beyond import beyond_runtime
from unbroken.sim.cluster import Fault
from unbroken.sim.engine import Engine
from unbroken.sim.log import SimLog
from unbroken.sim.scenario import Scenario
from unbroken.sim.segment import Segment

SIMPLIFICATIONS = (
    "faults inside a transition (restart, in-step recovery, rejoin) take effect when it ends",
    "slow episodes, rejoins and new quotas take effect at the next step boundary",
    "step time = max over replica groups of quota * microbatch_seconds * slowdown + sync_seconds",
)


class Run(abc.ABC):
    name = "base"
    ckpt_cost = 0.0  # s per persistent checkpoint; subclasses with checkpoints set it with ckpt_every
    ckpt_every = 0
    snapshot = 0.0  # s blocked per step for an in-memory snapshot
    replans = False  # whether it re-plans replica groups (policy/replan_scheduler.py): named in run_start

    def __init__(self, scenario: Scenario, faults: tuple[Fault, ...], log: SimLog, *, log_steps: bool = False,
                 aggregate_seconds: float = 3600.0, seed: int = 0):
        self.sc, self.faults, self.log, self.log_steps = scenario, faults, log, log_steps
        c, w = scenario.cluster, scenario.workload
        self.M, self.R, self.N, self.tpm = w.microbatches, c.dp, c.gpus, w.tokens_per_microbatch
        self.horizon, self.aggregate = w.duration_hours * 3600.0, aggregate_seconds
        self.costs = scenario.costs
        self.engine = Engine(seed)
        self.full_quotas = workload.quotas(self.M, range(self.R))
        self.t_full = max(self.full_quotas.values()) * w.microbatch_seconds + w.sync_seconds
        self.step = self.tokens = self.epoch = 0
        self.members: tuple[int, ...] = tuple(range(self.R))
        self.out: dict[int, tuple[float, str]] = {}  # replica -> (back at, cause)
        self.slow: dict[int, list[tuple[float, str]]] = defaultdict(list)  # replica -> [(factor, cause)]
        self.dead_gpus: set[int] = set()
        self.weights: dict[int, float] | None = None
        self.seg: Segment | None = None
        self.seg_id = self.seg_done = 0
        self.idle_from, self.idle_cause = 0.0, "startup"
        self.busy_until = 0.0
        self.lost: dict[str, float] = defaultdict(float)  # cause -> GPU-seconds
        self.since_ckpt = [0, 0, 0]  # steps, tokens, steps whose batch differed, since the last checkpoint
        self.ckpt_step = 0
        self.differ = 0
        self.gpu_s, self._gpu_t = 0.0, 0.0  # integral of in-service GPUs, GPU-s
        self.pending: dict[str, Any] | None = None
        self._replan_pending = -1

    # ---- the loop -------------------------------------------------------------------------------
    def simulate(self) -> dict[str, Any]:
        """Run to the horizon; returns the run_end record. Call once."""
        e = self.engine
        for kind in ("fault", "back", "resume", "replan", "tick", "slow_end", "detect"):
            e.on(kind, getattr(self, "_on_" + kind))
        self.log.emit("run_start", 0.0, strategy=self.name, scenario=self.sc.name, replicas=self.R, gpus=self.N,
                      steps=None, microbatches=self.M, tokens_per_microbatch=self.tpm, exact=False,
                      step_seconds=self.t_full, ckpt_every=self.ckpt_every, chosen=list(self.sc.chosen),
                      simplifications=list(SIMPLIFICATIONS), faults=len(self.faults),
                      beyond_runtime=beyond_runtime(self.sc, self.replans), **self.describe())
        for f in self.faults:
            e.at(f.t, "fault", f)
        e.at(self.aggregate, "tick")
        self.start(0.0)
        e.run(self.horizon)
        return self.finish(self.horizon)

    def describe(self) -> dict[str, Any]:
        """Strategy parameters for the run_start record."""
        return {}

    def end_fields(self) -> dict[str, Any]:
        """Strategy counters for the run_end record."""
        return {}

    def _on_tick(self, t: float, _: Any) -> None:
        if self.seg is not None:
            self.flush(t)
        self.emit_pending(t)
        self.engine.at(t + self.aggregate, "tick")

    def _on_fault(self, t: float, f: Fault) -> None:
        if f.scope == "slow":
            self.slow_begin(t, f)
        elif t < self.busy_until:
            self.engine.at(self.busy_until, "fault", f)
        else:
            if self.seg is not None:  # stretches commit lazily: without this, self.step is the step
                self.flush(t)  # of the last flush, and a strategy would recover the wrong step
            self.log.emit("fault", t, kind=f.cause, scope=f.scope, replica=list(f.replicas), step=self.step,
                          gpus=len(f.gpus))
            self.interrupt(t, f)

    def _on_back(self, t: float, replica: int) -> None:
        back, _ = self.out.get(replica, (t, ""))
        if back <= t and replica in self.out:
            del self.out[replica]
            self._gpu_clock(t)
            self.dead_gpus = {g for g in self.dead_gpus if g // self.sc.cluster.replica_gpus != replica}
            self.on_back(t, replica)

    def _on_resume(self, t: float, _: Any) -> None:
        self.start(t)

    # ---- hooks for strategies ---------------------------------------------------------------------
    @abc.abstractmethod
    def interrupt(self, t: float, f: Fault) -> None:
        """What this strategy does when fault `f` hits at virtual time `t`: every strategy defines it
        (restart.py, drop.py, live.py; detect.py inherits live.py's); the base has no recovery of its own."""

    def plan(self, members: tuple[int, ...]) -> tuple[float, int]:
        """(compute + sync seconds of one step, microbatches per step) on `members`, constant batch."""
        q = workload.quotas(self.M, members, self.weights)
        return max(q[r] * self.sc.workload.microbatch_seconds * self.slowdown(r) for r in members) \
            + self.sc.workload.sync_seconds, self.M

    def on_back(self, t: float, replica: int) -> None:
        """A replaced replica is usable again. Default: it joins at the next (re)start."""
        if self.seg is None and t >= self.busy_until:
            self.start(t)

    def on_slow(self, t: float) -> None:
        """Speeds changed. Default: the step time follows at the next step boundary."""
        self.replan(t)

    # ---- state changes ----------------------------------------------------------------------------
    def slowdown(self, r: int) -> float:
        episodes = self.slow.get(r)
        return max(f for f, _ in episodes) if episodes else 1.0

    def available(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.R) if r not in self.out)

    def mark_out(self, t: float, f: Fault, back_after: float) -> list[int]:
        """Take the fault's replica groups out of service until replaced; returns those newly out."""
        self._gpu_clock(t)
        self.dead_gpus.update(f.gpus)
        newly = [r for r in f.replicas if r not in self.out]
        for r in f.replicas:
            back = max(t + back_after, self.out.get(r, (0.0, ""))[0])
            self.out[r] = (back, f.cause)
            if back < float("inf"):
                self.engine.at(back, "back", r)
        return newly

    def slow_begin(self, t: float, f: Fault) -> None:
        for r in f.replicas:
            self.slow[r].append((f.factor, f.cause))
            self.log.emit("slow", t, replica=r, factor=f.factor, until=round(t + f.duration, 6), kind=f.cause)
        self.engine.at(t + f.duration, "slow_end", f)
        self.on_slow(t)

    def _on_slow_end(self, t: float, f: Fault) -> None:
        for r in f.replicas:
            self.slow[r].remove((f.factor, f.cause))
            self.log.emit("slow", t, replica=r, factor=1.0, until=round(t, 6), kind=f.cause)
        self.on_slow(t)

    def _on_detect(self, t: float, _: Any) -> None:
        pass  # strategies with a fail-slow detector observe committed steps here

    def start(self, t: float) -> None:
        """Begin a failure-free stretch at t on every available replica (or stay idle if none is)."""
        self.lost[self.idle_cause] += self.N * (t - self.idle_from)
        self.idle_from, self.busy_until = t, 0.0
        members = self.available()
        if not members:
            return
        if members != self.members:  # the runtime's membership policy: removals, then rejoins admitted
            alive = set(members)
            gone = [r for r in self.members if r not in alive]
            new = Membership(self.epoch, self.members).without(gone).admit(members)
            self.epoch, self.members = new.epoch, new.members
            self.log.emit("epoch", t, epoch=self.epoch, members=list(members))
        base, mbs = self.plan(members)
        causes = tuple(self.out[r][1] for r in sorted(self.out)) + \
            tuple(c for r in members for f, c in self.slow.get(r, ()) if f == self.slowdown(r))
        self.seg = Segment(t, self.step, base, self.snapshot, mbs, members, self.epoch, causes,
                           self.ckpt_every, self.ckpt_cost)
        self.seg_id += 1
        self.seg_done = 0

    def stop(self, t: float, cause: str, resume_after: float | None) -> float:
        """End the stretch at t: commit finished steps, lose the step in flight (to `cause`).

        Training stays idle (charged to `cause`) until `resume_after` s from now, or, with None, until
        the strategy calls `start`. Returns when the step in flight had started, s.
        """
        started = t
        if self.seg is not None:
            self.flush(t)
            started = self.seg.end_time(self.seg_done)
            self.lost[cause] += self.N * (t - started)
            self.seg = None
        self.emit_pending(t)
        self.idle_from, self.idle_cause = t, cause
        if resume_after is not None:
            self.busy_until = t + resume_after
            self.engine.at(self.busy_until, "resume")
        return started

    def replan(self, t: float, stall: float = 0.0, cause: str = "rejoin") -> None:
        """Rebuild the stretch from the current state at the next step boundary, after `stall` s."""
        if self.seg is None or t < self.busy_until or self._replan_pending == self.seg_id:
            return
        self.flush(t)
        self._replan_pending = self.seg_id
        self.engine.at(self.seg.end_time(self.seg_done + 1), "replan", (self.seg_id, stall, cause))

    def _on_replan(self, t: float, payload: tuple[int, float, str]) -> None:
        seg_id, stall, cause = payload
        if seg_id != self.seg_id or self.seg is None:
            return
        self.flush(t)
        self.stop(t, cause, stall if stall > 0 else None)
        if stall <= 0:
            self.start(t)

    def rollback(self, t: float, cause: str) -> None:
        """Undo the steps since the last persistent checkpoint (their useful time becomes lost)."""
        steps, tokens, differ = self.since_ckpt
        if steps:
            self.lost[cause] += self.N * tokens / (self.M * self.tpm) * self.t_full
            self.log.emit("rollback", t, to_step=self.ckpt_step, from_step=self.step, tokens=tokens,
                          total_tokens=self.tokens - tokens, reason=cause)
        self.step, self.tokens, self.differ = self.ckpt_step, self.tokens - tokens, self.differ - differ
        self.since_ckpt = [0, 0, 0]

    # ---- committing -------------------------------------------------------------------------------
    def flush(self, t: float) -> None:
        """Commit the steps of the current stretch finished by t."""
        seg = self.seg
        n = seg.steps_by(t) - self.seg_done
        if n > 0:
            self.commit(seg, n)

    def commit(self, seg: Segment, n: int, end: float | None = None) -> None:
        first, mbs = self.step, seg.microbatches
        tok = n * mbs * self.tpm
        useful = self.t_full * mbs / self.M  # failure-free cost of this step's tokens, s
        degraded = (seg.base - useful) * n * self.N
        for c in seg.causes or ("imbalance",):
            self.lost[c] += degraded / max(1, len(seg.causes))
        self.lost["snapshot"] += seg.overhead * n * self.N
        done0 = self.seg_done
        ckpts = seg.checkpoints(done0 + n) - seg.checkpoints(done0)
        self.lost["checkpoint"] += ckpts * seg.ckpt_cost * self.N
        if self.log_steps:
            for k in range(n):
                te = end if end is not None else seg.end_time(done0 + k + 1)
                self.log.emit("step", te, step=first + k, microbatches=mbs, replicas=len(seg.members),
                              epoch=seg.epoch, tokens=mbs * self.tpm, step_time=round(seg.step_time, 6))
        else:
            te = end if end is not None else seg.end_time(done0 + n)
            p = self.pending
            if p and p["microbatches"] == mbs and p["epoch"] == seg.epoch and p["first"] + p["count"] == first:
                p["count"] += n
                p["tokens"] += tok
                p["t"] = te
            else:
                self.emit_pending(te)
                self.pending = {"first": first, "count": n, "microbatches": mbs, "replicas": len(seg.members),
                                "epoch": seg.epoch, "tokens": tok, "t": te}
        self.step, self.tokens, self.seg_done = first + n, self.tokens + tok, done0 + n
        differ = n if mbs != self.M else 0
        self.differ += differ
        if ckpts:
            self.ckpt_step = (self.step // seg.ckpt_every) * seg.ckpt_every
            after = self.step - self.ckpt_step
            self.since_ckpt = [after, after * mbs * self.tpm, after if differ else 0]
        else:
            s = self.since_ckpt
            self.since_ckpt = [s[0] + n, s[1] + tok, s[2] + differ]

    def emit_pending(self, t: float) -> None:
        p, self.pending = self.pending, None
        if p:
            self._gpu_clock(t)
            te = p.pop("t")
            self.log.emit("steps", te, **p, total_tokens=self.tokens, gpu_hours=round(self.gpu_s / 3600, 6))

    def _gpu_clock(self, t: float) -> None:
        self.gpu_s += (self.N - len(self.dead_gpus)) * max(0.0, t - self._gpu_t)
        self._gpu_t = max(self._gpu_t, t)

    def finish(self, t: float) -> dict[str, Any]:
        if self.seg is not None:
            self.flush(t)
            self.lost["unfinished_step"] += self.N * (t - self.seg.end_time(self.seg_done))
            self.idle_from = t
        else:
            self.lost[self.idle_cause] += self.N * (t - self.idle_from)
        self.emit_pending(t)
        self._gpu_clock(t)
        useful = self.N * self.tokens / (self.M * self.tpm) * self.t_full
        return self._end(t, useful)

    def _end(self, t: float, useful: float) -> dict[str, Any]:
        lost = {c: round(s / 3600, 6) for c, s in sorted(self.lost.items()) if abs(s) > 1e-9}
        rec = dict(ok=True, steps_committed=self.step, seconds=t, tokens=self.tokens,
                   useful_gpu_hours=round(useful / 3600, 6), lost_gpu_hours=lost,
                   gpu_hours=round(self.N * t / 3600, 6), gpu_hours_in_service=round(self.gpu_s / 3600, 6),
                   steps_batch_differs=self.differ, epochs=self.epoch, **self.end_fields())
        self.log.emit("run_end", t, **rec)
        return {"event": "run_end", "t": t, **rec}
