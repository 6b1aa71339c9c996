"""What a re-plan cost, measured: for a group the scheduler shrank or grew, or kept or reweighted when it
turned Slow or Healthy again, the coordinator's `group_plan_measured` event, each figure beside the one
the `group_plan` decision predicted. (A dropped group computes nothing: nothing of it to measure.)

Owns: the groups awaiting measurement (`Pending`: the applied option and when it was decided), folding
each committed step's timings into them (`Measurer.observe`), and the event's fields (`fields`). Does
not own: the decision (coordinator/replan.py), or reading the store (slowness.py reads the steps' timings and
the joiner ranks' heal reports, `keys.healed`).

What is measured, and what the prediction beside it counts:
  replan_seconds  from the decision (the coordinator's wall clock, at the admission round) to the last
                  joiner rank's heal done (that rank's wall clock): the admission, the wait for the
                  donor's step boundary, the heal's rendezvous and transfer. Predicted: reform_seconds plus
                  the slowest receiver's pull at the stated peer bandwidth. Across hosts the two clocks
                  differ by their NTP skew (milliseconds).
                  Keep and reweight re-form nothing: 0 predicted, none measured (null).
  moved_bytes     bytes the joiner's ranks received over every heal of the admission (keep, reweight: 0,
                  no rank heals). Predicted: the
                  state the new plan's ranks lack (stepcost.moved_bytes: 16 B a block parameter, blocks
                  only); after a rank loss that is their whole holding, as the group missed a step
                  (scheduling.options), and a shrunk group's survivor pulls every shard index
                  (standin.py). A heal moves parameters and Adam state (12 B a parameter, embeddings
                  included), so the two differ by that. A grow is predicted at what the returning ranks
                  lack; this runtime's grow restarts the whole group, which re-pulls everything (~2x).
  weight          the group's tokens per device-second over the median of the other groups', the median
                  over its first MEASURE_STEPS committed steps on the new plan (keep, reweight: the steps
                  committed after the decision's). Predicted: the plan's quota weight (stepcost.rate),
                  which its quotas follow; for a reweight, the detector's speed estimate. None without
                  another group computing.
  step_seconds    the step's compute critical path: the largest device time any group spent on its
                  microbatches of the step, the median over the same steps. Predicted: the cost model's
                  whole step (the pipeline bubble, TP and PP links at the stated H100 speeds, the sync);
                  a device clock does not run while a stage waits, so the measured figure has neither the
                  bubble nor communication.
The measured weight of a shrink becomes the group's quota weight under run.quotas=speed
(replanning.GroupPlanner.measured): its quota follows its new speed, not the model's guess at it.
A coordinator that takes over (etcd standby) does not resume pending measurements: the leader's
decisions stay unmeasured.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from unbroken.policy.predictor import MicrobatchTiming
from unbroken.policy.replan_scheduler import Option

MEASURE_STEPS = 3  # committed steps on the new plan a measurement spans (its weight and step: medians)
IN_PLACE = ("keep", "reweight")  # options that re-form nothing: measured over the steps after the decision


@dataclass(frozen=True)
class Pending:
    """A re-plan applied to `group` at the admission round of `step`, being measured."""
    group: int
    why: str  # "rank lost" | "ranks back" (the group_plan event's)
    option: Option  # the applied option (shrink or grow) and its predictions
    step: int  # the coordinator's next step to read when it decided
    decided_at: float  # time.time() at the decision, s
    ranks: tuple[int, ...]  # the joiner's ranks that report their heals (a stand-in is rank 0)
    epoch: int  # the epoch in force at the decision: the new plan's steps commit in later ones
    seen: tuple[tuple[int, float | None, float], ...] = ()  # (step, weight, critical path s) per step
    # a plan re-formed in a new epoch (shrink, grow): its steps commit in epochs after `epoch`; else (keep,
    # reweight: the same ranks, new quotas) the steps after `step`
    reformed: bool = True


def step_figures(group: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> tuple[float | None, float]:
    """(`group`'s tokens per device-second over the median of the other computing groups', None when no
    other group computed; the step's compute critical path, s) from one committed step's timings, every
    group that computed a microbatch of it. Raises KeyError when `group` computed none."""
    working = {g: ms for g, ms in timings.items() if ms and sum(m.seconds for m in ms) > 0}

    def speed(ms: Sequence[MicrobatchTiming]) -> float:
        return sum(m.tokens for m in ms) / sum(m.seconds for m in ms)

    others = [speed(ms) for g, ms in working.items() if g != group]
    weight = speed(working[group]) / statistics.median(others) if others else None
    return weight, max(sum(m.seconds for m in ms) for ms in working.values())


class Measurer:
    """Call `begin` when a shrink, grow, keep or reweight is applied, `observe` with every committed step's
    timings, and `forget` when a group is declared dead (its measurement ends unreported: the plan it
    measured is gone). One measurement a group at a time: a keep or reweight while one is pending is not
    measured; a shrink or grow replaces it (the plan it measured is gone)."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}

    def begin(self, group: int, why: str, option: Option, step: int, decided_at: float, ranks: Sequence[int],
              epoch: int) -> None:
        """Measure `option`, applied to `group` when `step` was the next to read. `ranks`: the joiner's
        ranks reporting heals (none for keep and reweight, which re-form nothing). A drop is not measured:
        the group computes nothing (parked) or has left."""
        if option.kind == "drop":
            return
        reformed = option.kind not in IN_PLACE
        if group in self.pending and not reformed:
            return  # the plan being measured is still in force for these steps: finish that one first
        self.pending[group] = Pending(group, why, option, step, decided_at, tuple(ranks), epoch, (), reformed)

    def forget(self, group: int) -> None:
        self.pending.pop(group, None)

    def observe(self, step: int, timings: Mapping[int, Sequence[MicrobatchTiming]], epoch: int) -> list[Pending]:
        """Fold `step`, committed in `epoch`, into every pending group that computed in it; returns those
        now measured over MEASURE_STEPS steps (and no longer pending). Call once per committed step, in
        step order. A step committed in the decision's epoch or before is the old plan's, even when read
        after the decision: a group lost in its optimizer phase had its step committed, timings and all."""
        done = []
        for g, p in list(self.pending.items()):
            old = epoch <= p.epoch if p.reformed else step <= p.step
            if step < p.step or old or not any(m.seconds > 0 for m in timings.get(g, ())):
                continue  # the old plan's, or a step the group did not compute in (parked, admitted later)
            p = self.pending[g] = replace(p, seen=p.seen + ((step, *step_figures(g, timings)),))
            if len(p.seen) >= MEASURE_STEPS:
                done.append(self.pending.pop(g))
        return done


def fields(p: Pending, healed: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The `group_plan_measured` event of measured `p`; `healed`: the reports ({"bytes", "t"}) of the
    joiner ranks that wrote one (a rank that reported none leaves the re-plan time and bytes unknown)."""
    o = p.option
    weights = [w for _, w, _ in p.seen if w is not None]
    whole = bool(p.ranks) and len(healed) == len(p.ranks)  # keep, reweight: no joiner, nothing healed
    return {"replica": p.group, "why": p.why, "applied": o.kind, "plan": o.plan.shape() if o.plan else None,
            "decided_step": p.step, "steps": [s for s, _, _ in p.seen],
            "predicted_replan_seconds": round(o.replan_seconds, 6),
            "measured_replan_seconds": round(max(h["t"] for h in healed) - p.decided_at, 6) if whole else None,
            "predicted_moved_bytes": round(o.moved_bytes),
            "moved_bytes": sum(int(h["bytes"]) for h in healed) if whole else None if p.reformed else 0,
            "healed_ranks": len(healed),
            "predicted_weight": round(o.plan.weight, 4) if o.plan else 0.0,
            "measured_weight": round(statistics.median(weights), 4) if weights else None,
            "predicted_step_seconds": round(o.step_seconds, 6),
            "measured_step_seconds": round(statistics.median(c for _, _, c in p.seen), 6)}
