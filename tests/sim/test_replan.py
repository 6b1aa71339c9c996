"""The simulator's ResiHP strategy calls the real scheduler: its decisions are logged with every candidate's
predicted cost, it never changes the batch, shrinking beats dropping a group that lost one host, and the
'detector that reports but does not act' baseline moves nothing."""
from __future__ import annotations

import pytest

from unbroken.sim.beyond import BEYOND_RUNTIME
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import ScenarioError, from_tree, load

from tests.sim.conftest import small_tree


def events(recs, kind):
    return [r for r in recs if r["event"] == kind]


@pytest.mark.timeout(60)
def test_a_lost_host_shrinks_its_group_then_the_group_is_dropped_when_too_little_is_left():
    sc = load("scenarios/resihp_256_failstop.toml")
    res = {s: simulate(sc, s, seed=0, keep=True, aggregate_seconds=600) for s in ("unbroken_live", "unbroken_replan")}
    recs = res["unbroken_replan"].records
    start = events(recs, "run_start")[0]
    assert BEYOND_RUNTIME["replanning"] in start["beyond_runtime"] and start["full_plan"] == "tp8 pp4 [20,20,20,20]"
    faults, replans = events(recs, "fault"), events(recs, "group_plan")
    assert [r["t"] for r in replans] == [f["t"] for f in faults]  # one decision per fault, at the fault
    first, second = replans
    assert first["decision"] == "shrink" and first["plan"].startswith("tp8 pp3")
    assert first["moved_bytes"] > 0 and first["replan_seconds"] > sc.costs.reform_seconds
    drop = next(o for o in first["options"] if o["kind"] == "drop")
    assert first["predicted_step_seconds"] < drop["step_seconds"]
    # the second host of the same group: 16 ranks cannot hold 80 layers in 2 stages (60 GB each): drop
    assert second["decision"] == "drop" and {o["kind"] for o in second["options"]} == {"drop"}
    for r in res.values():
        assert r.end["steps_batch_differs"] == 0
    # 24 of the group's 32 GPUs keep working for half an hour: more tokens than dropping it at once
    assert res["unbroken_replan"].end["tokens"] > res["unbroken_live"].end["tokens"]


@pytest.mark.timeout(60)
def test_a_slow_rank_gets_its_stage_lightened_and_the_group_grows_back():
    sc = load("scenarios/resihp_256_failslow.toml")
    recs = simulate(sc, "unbroken_replan", seed=0, keep=True, aggregate_seconds=600).records
    replans = events(recs, "group_plan")
    assert [r["why"] for r in replans] == ["slow", "healthy again"] * len(sc.trace)
    slows = [e for e in events(recs, "slow") if e["factor"] > 1]
    for onset, (slow, healthy) in zip(slows, zip(replans[::2], replans[1::2])):
        assert slow["t"] > onset["t"] and slow["decision"] in ("repartition", "shrink")
        # the slow GPUs are ranks 0 and 1 of group 0, both on stage 0: it gets fewer layers, or its host none
        stages = [int(n) for n in slow["plan"].split("[")[1].rstrip("]").split(",")]
        assert sum(stages) == sc.model.layers and slow["replica"] == 0
        if slow["decision"] == "repartition":
            assert slow["teams"][0][0] == 0 and stages[0] < min(stages[1:])
        else:
            assert not {0, 1} & {r for team in slow["teams"] for r in team}
        assert healthy["t"] >= onset["until"] and healthy["plan"] == "tp8 pp4 [20,20,20,20]"
        keep = next(o for o in slow["options"] if o["kind"] == "keep")
        assert slow["predicted_step_seconds"] < keep["step_seconds"]  # doing nothing is predicted slower


@pytest.mark.timeout(60)
def test_detect_only_reports_and_moves_nothing():
    sc = load("scenarios/resihp_256_failslow.toml")
    recs = simulate(sc, "detect_only", seed=0, keep=True, aggregate_seconds=600).records
    assert [v for v in events(recs, "verdict") if v["new"] == "slow"]
    assert not events(recs, "quotas") and not events(recs, "group_plan")
    assert BEYOND_RUNTIME["replanning"] not in events(recs, "run_start")[0]["beyond_runtime"]
    acting = simulate(sc, "unbroken_replan", seed=0, aggregate_seconds=600).end
    assert acting["tokens"] > events(recs, "run_end")[0]["tokens"]


def test_a_model_table_that_cannot_fill_the_pipeline_is_refused():
    with pytest.raises(ScenarioError, match="model.layers=1 must be >= cluster.pp=2"):
        from_tree(small_tree(model={"layers": 1}))
    with pytest.raises(ScenarioError, match="unknown key 'hidden'"):
        from_tree(small_tree(model={"hidden": 8192}))
    assert from_tree(small_tree()).model.layers == 8


@pytest.mark.timeout(60)
def test_a_group_dropped_for_a_slow_rank_leaves_the_step_and_returns_after_its_episode(small):
    """3x slow ranks in groups of TP 2 x PP 2 (small scenario): dropping the group is predicted best; it
    leaves at the next step boundary and comes back once its episode is over, the batch unchanged."""
    recs = simulate(small, "unbroken_replan", seed=5, keep=True, log_steps=True).records
    drops = [e for e in events(recs, "group_plan") if e["why"] == "slow" and e["decision"] == "drop"]
    assert drops and all(s["microbatches"] == small.workload.microbatches for s in events(recs, "step"))
    for d in drops:
        r = d["replica"]
        onset = [e for e in events(recs, "slow") if e["replica"] == r and e["factor"] > 1 and e["t"] < d["t"]][-1]
        left = next(e for e in events(recs, "epoch") if e["t"] >= d["t"] and r not in e["members"])
        # at the next step boundary (the step in flight runs at the slow pace), after a re-form
        step = events(recs, "run_start")[0]["step_seconds"]
        assert left["t"] - d["t"] <= 2 * onset["factor"] * step + small.costs.reform_seconds
        ended = next(e for e in events(recs, "slow") if e["replica"] == r and e["factor"] == 1.0 and e["t"] > d["t"])
        back = next(e for e in events(recs, "group_plan") if e["replica"] == r and e["t"] > d["t"])
        assert back["why"] == "healthy again" and back["t"] >= ended["t"] + small.costs.rejoin_seconds
        assert back["plan"] == events(recs, "run_start")[0]["full_plan"]
