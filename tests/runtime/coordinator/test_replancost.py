"""A re-plan's measured cost beside its prediction (runtime/coordinator/replan_measure.py): the figures from committed
steps' timings and the joiner's heal reports, and the coordinator's `group_plan_measured` event, without
processes (a HashStore stands in for the coordinator's store). The torchrun path: tests/runtime/trainer/test_shrink.py."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from torch.distributed import HashStore

from unbroken.events import EventLog, read_events
from unbroken.policy.replan_plans import Plan
from unbroken.policy.predictor import MicrobatchTiming
from unbroken.policy.replan_scheduler import Option
from unbroken.runtime.store import keys
from unbroken.runtime.coordinator.replan_measure import MEASURE_STEPS, Measurer, fields, step_figures
from unbroken.runtime.coordinator.replan import GroupShape, planner_for
from unbroken.runtime.coordinator.slowness import SlownessMonitor

OPTION = Option("shrink", Plan(1, (2,), ((0,),), weight=0.5), 0.3, 0.12, 4096.0, 0.31, (0, 0, 1))


def mbs(n: int, seconds: float, tokens: int = 256) -> list[MicrobatchTiming]:
    return [MicrobatchTiming(tokens, tokens * 64.0, seconds)] * n


def test_step_figures_are_relative_speed_per_token_and_the_largest_group_time():
    # group 1: 2 microbatches at 0.04 s against groups 0 and 2 at 0.01-0.02 s per 256 tokens
    timings = {0: mbs(4, 0.01), 1: mbs(2, 0.04), 2: mbs(2, 0.02), 3: []}  # 3 parked: computes nothing
    weight, critical = step_figures(1, timings)
    assert weight == pytest.approx((256 / 0.04) / ((256 / 0.01 + 256 / 0.02) / 2))
    assert critical == pytest.approx(0.08)  # group 1's 2 x 0.04 s, more than group 0's 4 x 0.01 s
    assert step_figures(0, {0: mbs(4, 0.01)}) == (None, pytest.approx(0.04))  # nobody to compare with


def test_a_measurement_spans_the_group_s_first_steps_on_its_plan_and_reads_the_heal_reports():
    m = Measurer()
    m.begin(1, "rank lost", OPTION, step=3, decided_at=100.0, ranks=(0,), epoch=2)
    assert m.observe(2, {0: mbs(4, 0.01), 1: mbs(4, 0.01)}, 1) == []  # before the decision: not the new plan
    # committed in the decision's epoch though read after it: the old plan's (a loss in the optimizer phase)
    assert m.observe(3, {0: mbs(4, 0.01), 1: mbs(4, 0.01)}, 2) == []
    assert m.observe(5, {0: mbs(8, 0.01)}, 3) == []  # the group is not back yet
    assert m.observe(6, {0: mbs(4, 0.01), 1: mbs(4, 0.02)}, 3) == []
    assert m.observe(7, {0: mbs(4, 0.01), 1: mbs(4, 0.025)}, 3) == []
    (p,) = m.observe(8, {0: mbs(4, 0.01), 1: mbs(4, 0.02)}, 3)
    assert m.pending == {} and m.observe(9, {0: mbs(4, 0.01), 1: mbs(4, 0.02)}, 3) == []  # measured once
    e = fields(p, [{"bytes": 5000, "t": 101.25}])
    assert e["steps"] == [6, 7, 8] and len(e["steps"]) == MEASURE_STEPS and e["decided_step"] == 3
    assert (e["applied"], e["plan"], e["why"]) == ("shrink", "tp1 pp1 [2]", "rank lost")
    assert e["measured_replan_seconds"] == pytest.approx(1.25) and e["predicted_replan_seconds"] == 0.12
    assert (e["moved_bytes"], e["predicted_moved_bytes"], e["healed_ranks"]) == (5000, 4096, 1)
    assert e["measured_weight"] == pytest.approx(0.5) and e["predicted_weight"] == 0.5  # median of .5 .4 .5
    assert e["measured_step_seconds"] == pytest.approx(0.08) and e["predicted_step_seconds"] == 0.3
    unreported = fields(p, [])  # the joiner's rank never said its heal was done: unknown, not zero
    assert unreported["measured_replan_seconds"] is None and unreported["moved_bytes"] is None


def test_a_group_declared_dead_before_it_is_measured_is_not_reported():
    m = Measurer()
    m.begin(1, "ranks back", OPTION, step=5, decided_at=100.0, ranks=(0, 1), epoch=2)
    m.observe(6, {0: mbs(4, 0.01), 1: mbs(4, 0.01)}, 3)
    m.forget(1)
    assert [m.observe(s, {0: mbs(4, 0.01), 1: mbs(4, 0.01)}, 3) for s in (7, 8, 9)] == [[], [], []]


def test_a_reweight_is_measured_over_the_steps_after_its_decision_and_moves_nothing():
    """Keep and reweight re-form nothing: their steps commit in the same epoch, after the decision's step;
    no rank heals (0 bytes moved, the re-plan time unknown). A keep or reweight while another measurement
    is pending is not measured; a shrink replaces a pending reweight's; a drop is never measured."""
    reweight = Option("reweight", Plan(1, (1, 1), ((0,), (1,)), weight=0.34), 0.3, 0.0, 0.0, 0.3, (0, 0, 1))
    m = Measurer()
    m.begin(1, "slow", reweight, step=4, decided_at=100.0, ranks=(), epoch=0)
    assert m.observe(4, {0: mbs(4, 0.01), 1: mbs(4, 0.03)}, 0) == []  # the decision's own step: before it
    assert m.observe(5, {0: mbs(4, 0.01), 1: mbs(2, 0.03)}, 0) == []
    m.begin(1, "healthy again", replace(reweight, kind="keep"), step=5, decided_at=101.0, ranks=(), epoch=0)
    assert m.observe(6, {0: mbs(4, 0.01), 1: mbs(2, 0.03)}, 0) == []
    (p,) = m.observe(7, {0: mbs(4, 0.01), 1: mbs(2, 0.02)}, 0)
    e = fields(p, [])
    assert (e["why"], e["applied"], e["steps"]) == ("slow", "reweight", [5, 6, 7])
    assert (e["moved_bytes"], e["predicted_moved_bytes"], e["healed_ranks"]) == (0, 0, 0)
    assert e["measured_replan_seconds"] is None and e["predicted_replan_seconds"] == 0.0
    assert e["measured_weight"] == pytest.approx(1 / 3, abs=1e-4) and e["predicted_weight"] == 0.34
    m.begin(1, "slow", reweight, step=8, decided_at=102.0, ranks=(), epoch=0)
    m.begin(1, "rank lost", OPTION, step=9, decided_at=103.0, ranks=(0,), epoch=0)
    assert m.pending[1].option.kind == "shrink" and m.pending[1].reformed
    m.begin(2, "slow", replace(reweight, kind="drop", plan=None), step=9, decided_at=104.0, ranks=(), epoch=0)
    assert 2 not in m.pending  # a dropped (parked) group computes nothing to measure


def committed(store, step: int, groups: dict[int, float]) -> None:
    """Step `step` committed in epoch 0 by `groups` (group -> seconds per microbatch), 4 microbatches each."""
    store.set(keys.decision(step, 0), "commit@0")
    for g, seconds in groups.items():
        store.set(keys.done(step, 0, g), json.dumps({"timings": [[256, 256 * 64, seconds]] * 4}))
    store.set(keys.last_commit(), str(step))


def watching(tmp_path) -> tuple[HashStore, SlownessMonitor]:
    """A coordinator's monitor (run.quotas=speed, the scheduler asked) of 2 groups of 2 pipeline stages,
    over a store that holds nothing committed yet; its events go to tmp_path."""
    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.weights(), "{}")
    log = EventLog(tmp_path / "events.jsonl", who="coordinator")
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=1000, reform_seconds=0.1)
    return store, SlownessMonitor(store, log, quotas="speed", planner=planner_for(shape, 2, log, "speed"))


def shrunk(tmp_path) -> tuple[HashStore, SlownessMonitor]:
    """The monitor of `watching` after 6 healthy steps, group 1 then declared dead for a lost rank and
    shrunk onto its survivor (the scheduler's choice, asserted)."""
    store, monitor = watching(tmp_path)
    for s in range(6):
        committed(store, s, {0: 0.01, 1: 0.01})
    monitor.poll(0)
    monitor.forget(1)  # group 1 lost a rank and was declared dead
    assert monitor.rank_lost(1, [0], [0]) == "shrink"
    return store, monitor


def test_the_coordinator_logs_a_shrink_s_measured_cost_beside_its_prediction(tmp_path):
    before = time.time()
    store, monitor = shrunk(tmp_path)
    store.set(keys.joined(1), "2")  # admitted in epoch 2; its stand-in healed 9000 bytes
    store.set(keys.healed(1, 2, 0), json.dumps({"bytes": 9000, "t": before + 0.75}))
    committed(store, 6, {0: 0.01})  # the heal's step: group 1 not computing yet
    for s in range(7, 7 + MEASURE_STEPS + 2):
        committed(store, s, {0: 0.01, 1: 0.02})  # the stand-in runs both stages: half the speed
    monitor.poll(0)
    (plan,) = [e for e in read_events(tmp_path) if e["event"] == "group_plan" and e["why"] == "rank lost"]
    (measured,) = [e for e in read_events(tmp_path) if e["event"] == "group_plan_measured"]
    assert measured["replica"] == 1 and measured["steps"] == [7, 8, 9] and measured["step"] == 9
    assert measured["applied"] == plan["applied"] == "shrink" and measured["plan"] == plan["plan"]
    assert measured["predicted_weight"] == plan["applied_weight"]
    assert measured["measured_weight"] == pytest.approx(0.5)
    assert measured["moved_bytes"] == 9000 and measured["healed_ranks"] == 1
    assert 0 < measured["measured_replan_seconds"] <= 0.75 + (time.time() - before)
    assert measured["measured_step_seconds"] == pytest.approx(0.08)


@pytest.mark.parametrize("stand_in_seconds", [0.01, 0.004])
def test_a_shrunk_group_s_quota_follows_its_measured_speed(tmp_path, stand_in_seconds):
    """Under run.quotas=speed the measured speed replaces the cost model's weight (0.5 predicted for one
    rank running both stages) and is published: a stand-in as fast as its peers gets equal quotas, one
    measured faster (a TP group shrunk on this host measured 2.0-2.5x) more. A successor resumes it."""
    monitor, events = shrunk_then_measured(tmp_path, stand_in_seconds)
    (measured,) = [e for e in events if e["event"] == "group_plan_measured"]
    assert measured["quota_weight"] == round(0.01 / stand_in_seconds, 2) != measured["predicted_weight"]
    assert monitor.planner.shrunk_plans()[1].weight == measured["quota_weight"]
    assert [e["weights"] for e in events if e["event"] == "quotas"][-1]["1"] == measured["quota_weight"]


@pytest.mark.parametrize("stand_in_seconds, applied", [(0.02, "keep"), (0.05, "reweight")])
def test_a_shrunk_group_declared_slow_is_reweighted_only_below_its_plan(tmp_path, stand_in_seconds, applied):
    """A stand-in is declared Slow within the 3 measured steps. At half its peers' speed, what its plan
    (one rank running both stages: 0.5) predicts, its device is not slow (`device_speed` 1): kept, and the
    measurement sets its quota weight (0.5). At a fifth (a device at 0.4 of its plan's) it is reweighted
    to its speed: the measurement then changes nothing (quota_weight null), the detector's weight stands."""
    monitor, events = shrunk_then_measured(tmp_path, stand_in_seconds)
    (slow,) = [e for e in events if e["event"] == "group_plan" and e["why"] == "slow"]
    assert (slow["replica"], slow["shrunk"], slow["applied"]) == (1, True, applied), slow
    assert slow["device_speed"] == pytest.approx(min(1.0, 0.01 / stand_in_seconds / 0.5), abs=0.05)
    (measured,) = [e for e in events if e["event"] == "group_plan_measured"]
    assert measured["measured_weight"] == pytest.approx(0.01 / stand_in_seconds)
    if applied == "keep":
        assert measured["quota_weight"] == 0.5 and monitor.planner.weight_of(1, 0.42) == 0.5
    else:
        assert measured["quota_weight"] is None
        assert monitor.planner.weight_of(1, 0.18) == 0.18  # reweighted: its quota follows the detector


def shrunk_then_measured(tmp_path, stand_in_seconds: float) -> tuple[SlownessMonitor, list[dict]]:
    """Group 1 shrunk after 6 healthy steps, then MEASURE_STEPS steps at `stand_in_seconds` a microbatch
    against group 0's 0.01: the monitor and its events."""
    store, monitor = shrunk(tmp_path)
    for s in range(6, 6 + MEASURE_STEPS):
        committed(store, s, {0: 0.01, 1: stand_in_seconds})
    monitor.poll(0)
    return monitor, read_events(tmp_path)


def test_the_coordinator_measures_a_slow_group_s_reweight(tmp_path):
    """Two healthy groups of 2 pipeline stages, then group 1 at 3x the time per microbatch: the detector
    declares it Slow, the scheduler reweights it (run.quotas=speed), and once 3 steps have committed
    after that decision the coordinator logs what the group's speed measured beside the weight given."""
    store, monitor = watching(tmp_path)
    for s in range(8):
        committed(store, s, {0: 0.01, 1: 0.01})
    for s in range(8, 20):
        committed(store, s, {0: 0.01, 1: 0.03})
    monitor.poll(0)
    events = read_events(tmp_path)
    (plan,) = [e for e in events if e["event"] == "group_plan" and e["why"] == "slow"]
    assert plan["replica"] == 1 and plan["applied"] == "reweight"
    (measured,) = [e for e in events if e["event"] == "group_plan_measured"]
    assert (measured["why"], measured["applied"], measured["replica"]) == ("slow", "reweight", 1)
    assert measured["steps"] == list(range(plan["step"] + 1, plan["step"] + 1 + MEASURE_STEPS))
    assert measured["predicted_weight"] == plan["applied_weight"]
    assert measured["measured_weight"] == pytest.approx(1 / 3, abs=1e-4)  # rounded to 4 places
    assert measured["moved_bytes"] == 0 and measured["quota_weight"] is None
