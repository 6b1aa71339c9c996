"""unbroken's live recovery, with and without the fail-slow detector.

Owns: in-step recovery on the virtual clock. When replica groups die inside step s, the survivors keep
what they computed, block at the all-reduce until the heartbeat timeout declares the dead, re-form, and
compute the orphaned microbatches given to them by `unbroken.policy.workload.redistribute`; step s still
reduces all M microbatches. Later steps use `workload.assign` over the survivors (quotas by weight), so
the batch never changes; the step time grows instead. Where affordable (members x M <= DRIVE_LIMIT) every
survivor's `unbroken.policy.recovery` state machine is driven through the step, and its owed microbatches
must match the redistribution; above that, the first survivor that takes work is driven as a check.
A software failure restarts every process from the per-step in-memory snapshot (the snapshot agents
outlive the trainers). Does not own: shared bookkeeping (base.py), the policy functions themselves.

`LiveDetect` (detect.py) adds the fail-slow detector of `unbroken.policy.detection`.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from unbroken.policy import recovery, workload
from unbroken.sim.cluster import Fault
from unbroken.sim.segment import Segment
from unbroken.sim.strategies.base import Run

DRIVE_LIMIT = 20_000  # members x microbatches up to which every survivor's state machine is driven


def drive(step: int, me: int, epoch: int, members: tuple[int, ...], survivors: tuple[int, ...], m: int,
          weights: dict[int, float] | None) -> tuple[int, ...]:
    """Run one survivor's recovery state machine through a step that loses `members - survivors`.

    The survivor computes its plan, its reduce fails, the epoch moves, the retry is decided, it computes
    what it owes in the new epoch and commits. Returns the microbatches it redid (beyond its own plan).
    Raises AssertionError if the machine does not end committed holding exactly its new owners' share.
    """
    chain = ((epoch + 1, survivors),)
    state, actions = recovery.start(step, me, epoch, members, m, weights)
    own = workload.mine(state.owners, me)
    redo: list[int] = []
    while actions:
        act, event = actions[0], None
        match act:
            case recovery.Compute(_, mbs):
                if state.epoch != epoch:
                    redo.extend(mbs)
                event = recovery.Computed(mbs)
            case recovery.Reduce(_, e):
                event = recovery.ReduceFailed(e, "peer lost") if e == epoch else recovery.Reduced(e)
            case recovery.AwaitEpoch():
                event = recovery.EpochChanged(chain)
            case recovery.Publish(_, e, _):
                event = recovery.Published(e, len(survivors))
            case recovery.Propose(_, e, outcome):
                event = recovery.Decided(e, outcome, chain if outcome == "retry" else ())
            case recovery.Apply() | recovery.Fence():
                break
        state, actions = recovery.on_event(state, event)
    assert state.phase is recovery.Phase.COMMITTED, state
    assert state.held == workload.mine(state.owners, me) and not (set(redo) & own), state
    return tuple(sorted(redo))


class Live(Run):
    name = "unbroken_live"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.snapshot = self.costs.snapshot_seconds

    def interrupt(self, t: float, f: Fault) -> None:
        c = self.costs
        if f.scope == "software":
            down = c.detect_seconds + c.restart_seconds + c.memory_restore_seconds
            self.stop(t, f.cause, down)
            self.log.emit("restart", t, seconds=round(down, 6), reason=f.cause, members=len(self.available()))
            return
        hit = tuple(r for r in f.replicas if r in self.members and r not in self.out)
        self.mark_out(t, f, c.replace_seconds + c.rejoin_seconds)
        if not hit or self.seg is None:
            return
        self.in_step(t, f.cause, hit)

    def in_step(self, t: float, cause: str, dead: tuple[int, ...]) -> None:
        """Recover step `self.step` inside itself; it commits with all M microbatches at the end."""
        seg, c, w = self.seg, self.costs, self.sc.workload
        step, epoch, members = self.step, seg.epoch, seg.members
        survivors = tuple(r for r in members if r not in dead)
        started = self.stop(t, cause, None)
        for r in dead:
            self.log.emit("member_dead", t, replica=r, epoch=epoch + 1, reason=cause)
        if not survivors:
            return  # nobody left: idle until a replica group is back (base.on_back starts again)
        old = workload.assign(self.M, members, self.weights)
        new = workload.redistribute(old, survivors, self.weights)
        own = Counter(old)
        redo: dict[int, list[int]] = {}
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                redo.setdefault(b, []).append(i)
        checked = survivors if len(members) * self.M <= DRIVE_LIMIT else tuple(sorted(redo))[:1]
        for r in checked:
            assert list(drive(step, r, epoch, members, survivors, self.M, self.weights)) == redo.get(r, []), r
        # a survivor finishes its own work, waits for the verdict and the re-form, then redoes orphans
        resume = t + c.detect_seconds + c.reform_seconds
        finish = max(max(started + own[r] * w.microbatch_seconds * self.slowdown(r), resume)
                     + len(redo.get(r, ())) * w.microbatch_seconds * self.slowdown(r) for r in survivors)
        end = finish + w.sync_seconds + self.snapshot
        self.epoch += 1
        self.members = survivors
        self.log.emit("epoch", t + c.detect_seconds, epoch=self.epoch, members=list(survivors))
        for r, mbs in sorted(redo.items()):
            self.log.emit("recovery", resume, step=step, replica=r, from_epoch=epoch, to_epoch=self.epoch,
                          redo=mbs)
        self.busy_until = end
        self.engine.at(end, "resume", (step, started, cause))

    def _on_resume(self, t: float, payload: Any) -> None:
        if payload is not None:  # the recovered step commits now, with every microbatch
            step, started, cause = payload
            if step == self.step:
                self.lost[cause] += self.N * (t - self.idle_from)
                self.lost[cause] -= self.N * self.t_full  # its failure-free cost is useful after all
                self.idle_from = t
                # a one-step stretch costing exactly the failure-free step: the rest is charged above
                self.commit(Segment(started, step, self.t_full, 0.0, self.M, self.members, self.epoch,
                                    (cause,)), 1, end=t)
        self.start(t)

    def on_back(self, t: float, replica: int) -> None:
        if self.seg is None:
            super().on_back(t, replica)
        else:
            self.replan(t, self.costs.reform_seconds, "rejoin")

