"""The coordinator's re-planning step without processes: verdict changes in, `group_plan` events and quota
weights out (runtime/control/replanning.py). The torchrun path is tests/runtime/test_slow_pp.py."""
from __future__ import annotations

from unbroken.events import EventLog, read_events
from unbroken.policy.detection import Verdict, VerdictChange
from unbroken.policy.predictor import MicrobatchTiming, Predictor
import pytest

from unbroken.policy.workload import PARKED
from unbroken.runtime.control.replanning import DROP, EQUAL, GroupShape, planner_for

SHAPE = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=20)
TIMINGS = {g: [MicrobatchTiming(256, 16384.0, 0.004)] * 4 for g in (0, 1)}


def changes(step: int, new: Verdict, old: Verdict, speed: float) -> list[VerdictChange]:
    return [VerdictChange(step, 1, old, new, speed, 0.9)]


def test_slow_then_healthy_reweights_then_keeps_and_logs_each_decision(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    planner = planner_for(SHAPE, 2, log, quotas="speed")
    assert planner.weight_of(1, 0.4) == 1.0  # no decision yet: equal quotas
    planner.on_verdicts(changes(3, Verdict.SUSPECT, Verdict.HEALTHY, 1.0), TIMINGS, Predictor(), [0, 1])
    assert read_events(tmp_path) == []  # Healthy -> Suspect decides nothing
    planner.on_verdicts(changes(4, Verdict.SLOW, Verdict.SUSPECT, 0.4), TIMINGS, Predictor(), [0, 1])
    assert planner.weight_of(1, 0.4) == 0.4 and planner.weight_of(0, 1.0) == 1.0
    planner.on_verdicts(changes(9, Verdict.HEALTHY, Verdict.SLOW, 1.0), TIMINGS, Predictor(), [0, 1])
    assert planner.weight_of(1, 0.4) == 1.0
    slow, healthy = read_events(tmp_path)
    assert (slow["why"], slow["applied"], slow["cost_source"]) == ("slow", "reweight", "measured median")
    assert slow["horizon_steps"] == 16.0 and slow["per_microbatch_seconds"] == 0.004
    assert {"drop", "keep", "reweight"} <= {o["kind"] for o in slow["options"]}
    assert "drop" in slow["not_executable"] and "keep" not in slow["not_executable"]
    assert (healthy["why"], healthy["applied"], healthy["speed"]) == ("healthy again", "keep", 1.0)


def test_equal_quotas_apply_keep_and_a_takeover_resumes_the_reweighted_groups(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    planner = planner_for(SHAPE, 2, log, quotas="equal")
    planner.on_verdicts(changes(4, Verdict.SLOW, Verdict.SUSPECT, 0.4), TIMINGS, Predictor(), [0, 1])
    (e,) = read_events(tmp_path)
    assert e["applied"] == "keep" and e["not_executable"]["reweight"] == EQUAL
    assert planner.weight_of(1, 0.4) == 1.0
    standby = planner_for(SHAPE, 2, log, quotas="speed")
    standby.resume({0: 1.0, 1: 0.4})
    assert standby.weight_of(1, 0.38) == 0.38 and standby.weight_of(0, 1.0) == 1.0


def test_groups_sharded_with_fsdp_or_without_a_shape_are_not_planned(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    assert planner_for(None, 2, log, "speed") is None
    fsdp = GroupShape(group_size=4, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=20)
    assert planner_for(fsdp, 2, log, "speed") is None


def test_drop_quotas_park_a_slow_group_for_good_and_a_takeover_keeps_it_parked(tmp_path):
    """run.quotas=drop: the scheduler still decides and logs its choice, drop is applied (every other kind
    refused, saying why), and the group's quota weight is PARKED from then on; a Slow verdict the cost model
    cannot price parks nothing, and leaving Slow never parks."""
    log = EventLog(tmp_path / "events.jsonl")
    planner = planner_for(SHAPE, 2, log, quotas="drop")
    planner.on_verdicts(changes(4, Verdict.SLOW, Verdict.SUSPECT, 0.4), TIMINGS, Predictor(), [0, 1])
    (e,) = read_events(tmp_path)
    assert (e["why"], e["applied"], e["applied_weight"]) == ("slow", "drop", 0.0)
    assert e["not_executable"]["reweight"] == DROP and e["decision"] in {o["kind"] for o in e["options"]}
    assert planner.weight_of(1, 0.4) == PARKED and planner.weight_of(0, 1.0) == 1.0
    standby = planner_for(SHAPE, 2, log, quotas="drop")
    standby.resume({0: 1.0, 1: PARKED})
    assert standby.weight_of(1, 0.4) == PARKED and standby.weight_of(0, 1.0) == 1.0
    planner.forget(1)  # declared dead: it comes back whole, with a fresh record
    assert planner.weight_of(1, 1.0) == 1.0
    planner.on_verdicts(changes(9, Verdict.HEALTHY, Verdict.SLOW, 1.0), TIMINGS, Predictor(), [0, 1])
    assert read_events(tmp_path)[-1]["applied"] == "keep" and planner.weight_of(1, 1.0) == 1.0
    with pytest.raises(ValueError, match="quotas='fast'"):
        planner_for(SHAPE, 2, log, quotas="fast")
