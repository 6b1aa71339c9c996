"""A fail-slow rank inside a pipeline group, through real torchrun jobs (2 groups x PP 2, gloo, --exact):
rank 1 (the last stage) of group 1 spins 3x its compute from step 2. Each stage reports its own device
time, the coordinator times the group by its slowest stage, its detector declares group 1 Slow and
locates its rank 1, the scheduler (policy/replan_scheduler.py) is
called and its decision logged as a `group_plan` event with every candidate's predicted step time and
re-plan cost; the runtime applies reweight (keep under --run.quotas=equal, drop under --run.quotas=drop:
the group parked for the rest of the run) and says why the others are not executable. Oracle: the event log, the audit, and the PP oracle's digests (quotas
decide who computes a microbatch, never what is summed).
"""
from __future__ import annotations

import statistics

import pytest

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import digests, plain_loop
from tests.runtime.parallel.test_pp_tp import staged
from unbroken.config import Config
from unbroken.events import read_events, steps
from unbroken.observe.runs import audit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, M = 16, 8
RUN = ["--replicas", "2", "--steps", str(STEPS), "--microbatches", str(M), "--exact", "--run.progress=false",
       "--coord.heartbeat_timeout=3.0", "--coord.run_timeout=200", "--model.dropout=0",
       "--parallel.group_size=2", "--parallel.pp=2", "--faults", "slow:replica=1,rank=1,from=2,factor=3,how=spin"]


def per_token(events, replica: int, first: int) -> float:
    """Median device seconds per token of `replica`'s microbatches from step `first` on, each at its slowest
    stage's (every stage logs its own)."""
    worst: dict[tuple[int, int], float] = {}
    for e in events:
        if e["event"] == "compute" and e["replica"] == replica and e["step"] >= first:
            key = (e["step"], e["microbatch"])
            worst[key] = max(worst.get(key, 0.0), e["seconds"] / e["tokens"])
    return statistics.median(worst.values())


def plan_events(events, replica: int) -> list[dict]:
    return [e for e in events if e["event"] == "group_plan" and e["replica"] == replica]


def measured(events, replica: int) -> list[dict]:
    return [e for e in events if e["event"] == "group_plan_measured" and e["replica"] == replica]


def test_slow_stage_is_detected_reweighted_by_the_scheduler_and_the_trajectory_holds(tmp_path):
    out = tmp_path / "speed"
    r = unbroken("train", *RUN, "--run.quotas=speed", "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)

    # The fault fired and reached the measured times: group 1 (its slowest stage's device time) costs well
    # over group 0 per token from step 2 (3x injected; 1.5x asserted, device time ignores core contention).
    assert per_token(events, 1, 2) > 1.5 * per_token(events, 0, 2)

    verdicts = [e for e in events if e["event"] == "verdict" and e["new"] == "slow"]
    assert verdicts and {e["replica"] for e in verdicts} == {1}, verdicts
    declared = verdicts[0]["step"]
    assert declared <= STEPS - 4, declared  # room for later steps to show the new quotas

    plan = plan_events(events, 1)[0]
    assert plan["why"] == "slow" and plan["step"] == declared
    # the slow stage located: rank 1 against rank 1 of the peer group (policy/locating.py), rank 0 healthy
    assert plan["located"] == [1] and plan["rank_speeds"]["1"] < 0.7, plan
    assert plan["rank_speeds"]["1"] < plan["rank_speeds"]["0"], plan  # rank 0: healthy, or slowed by sharing cores
    kinds = {o["kind"]: o for o in plan["options"]}
    assert {"drop", "keep", "reweight"} <= set(kinds) and plan["decision"] in kinds
    assert all(o["step_seconds"] > 0 and o["replan_seconds"] >= 0 for o in plan["options"])
    assert plan["applied"] == "reweight" and 0 < plan["applied_weight"] < 1
    assert kinds["reweight"]["step_seconds"] < kinds["keep"]["step_seconds"]  # predicted to pay
    assert {"drop", "shrink"} <= set(plan["not_executable"]) and "reweight" not in plan["not_executable"]
    assert plan_events(events, 0) == []  # the healthy group is never re-planned
    # What the reweight met, measured over the 3 steps committed after the decision: group 1's speed per
    # token beside the weight it was given (the detector's estimate); nothing re-formed, nothing moved
    (m,) = measured(events, 1)
    assert (m["why"], m["applied"], m["decided_step"]) == ("slow", "reweight", declared)
    assert m["steps"] == [declared + 1, declared + 2, declared + 3]
    assert m["predicted_weight"] == plan["applied_weight"] and m["measured_weight"] < 1 / 1.5
    assert (m["moved_bytes"], m["healed_ranks"], m["measured_replan_seconds"]) == (0, 0, None)

    # Quotas moved after the decision: group 1 holds fewer microbatches than group 0 on later steps.
    record = steps(events)
    assert sorted(record) == list(range(STEPS))
    later = [s for s in record if s > declared]
    lighter = [s for s in later if len(record[s]["owners"]["1"]) < len(record[s]["owners"]["0"])]
    assert lighter, {s: record[s]["owners"] for s in later}
    # Every step reduced all M microbatches, each once; the audit agrees; the trajectory is the oracle's.
    assert all(sorted(i for mbs in record[s]["owners"].values() for i in mbs) == list(range(M)) for s in record)
    assert audit(out, M) == []
    cfg = Config.from_json((out / "config.json").read_text())
    want, _, _ = plain_loop(cfg, split=False, digest=staged(2))
    assert [digests(out)[s] for s in range(STEPS)] == want


def test_under_equal_quotas_the_decision_is_logged_and_only_keep_is_applied(tmp_path):
    """--run.quotas=equal ("do nothing"): the scheduler still decides and the event says so, but the
    runtime applies keep (reweight not executable: quotas never follow speed) and quotas stay 4 and 4."""
    out = tmp_path / "equal"
    r = unbroken("train", *RUN, "--run.quotas=equal", "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    plans = plan_events(events, 1)
    assert plans and plans[0]["why"] == "slow", [e for e in events if e["event"] == "verdict"]
    assert plans[0]["applied"] == "keep" and "run.quotas=equal" in plans[0]["not_executable"]["reweight"]
    assert plans[0]["decision"] != "keep"  # the scheduler would act; the run was told not to
    (m,) = measured(events, 1)  # keep is measured as reweight is: the group's speed, the same weight 1
    assert (m["why"], m["applied"], m["predicted_weight"]) == ("slow", "keep", 1.0) and m["measured_weight"] < 1 / 1.5
    assert all(len(mbs) == M // 2 for rec in steps(events).values() for mbs in rec["owners"].values())
    assert audit(out, M) == []


def test_under_drop_quotas_the_slow_group_is_parked_and_the_trajectory_holds(tmp_path):
    """--run.quotas=drop (ResiHP's drop baseline): the decision is logged, drop applied, and group 1 owns no
    microbatch of any later step while group 0 computes all M; group 1 stays in every step's reduction
    (a zero share), so it is never declared dead, and the trajectory is the oracle's."""
    out = tmp_path / "drop"
    r = unbroken("train", *RUN, "--run.quotas=drop", "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert per_token(events, 1, 2) > 1.5 * per_token(events, 0, 2)  # the fault fired (while it computed)
    (plan,) = plan_events(events, 1)
    assert plan["why"] == "slow" and plan["applied"] == "drop" and plan["applied_weight"] == 0.0
    assert "run.quotas=drop" in plan["not_executable"]["reweight"]
    assert not [e for e in events if e["event"] == "member_dead"]
    assert measured(events, 1) == []  # a parked group computes nothing: nothing to measure
    record = steps(events)
    assert sorted(record) == list(range(STEPS))
    parked = [s for s in record if s > plan["step"] and not record[s]["owners"].get("1")]
    assert parked and parked == list(range(parked[0], STEPS)), {s: record[s]["owners"] for s in record}
    assert all(record[s]["owners"]["0"] == list(range(M)) for s in parked)
    assert all(sorted(i for mbs in record[s]["owners"].values() for i in mbs) == list(range(M)) for s in record)
    assert audit(out, M) == []
    cfg = Config.from_json((out / "config.json").read_text())
    want, _, _ = plain_loop(cfg, split=False, digest=staged(2))
    assert [digests(out)[s] for s in range(STEPS)] == want


def test_under_replan_the_group_shrinks_around_its_located_slow_rank_and_the_trajectory_holds(tmp_path):
    """--parallel.on_rank_loss=replan: the scheduler, told rank 1 is the slow one, prefers rank 0 alone
    running the whole model (speed ~1/2) to the group at 1/3; the coordinator declares group 1 dead naming
    rank 1 (its fence ends it), rank 0 asks to go on shrunk, the scheduler chooses shrink again with rank 0
    alive, and the stand-in heals from group 0 and computes on. Group 0 sleeps through 10x its compute in
    steps 6-13 (wall time only) so the stand-in's rebuild and heal land with steps left. Bitwise on the
    pipeline's trajectory throughout. Each rank's agent has a restart left (`--run.restarts=1`): the
    evicted rank's fence ends its agent anyway (release_agent), since a restart in place would bring the
    group back on the same slow device; before, torchrun restarted it and the group re-formed with it."""
    out = tmp_path / "evict"
    run = [*RUN[:-1], RUN[-1] + "; slow:replica=0,from=6,to=14,factor=10,how=sleep"]
    r = unbroken("train", *run, "--run.quotas=speed", "--parallel.on_rank_loss=replan", "--run.restarts=1",
                 "--hardware.reform_seconds=0.01", "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    slow, lost = plan_events(events, 1)[:2]
    assert (slow["why"], slow["located"], slow["applied"]) == ("slow", [1], "shrink"), slow
    (dead,) = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    assert dead["reason"].startswith("rank 1: evicted, slow"), dead
    assert [e["rank"] for e in events if e["event"] == "fenced" and e["replica"] == 1] == [1]
    # the evicted rank never claimed to go on (it did once, when its peers' leaving broke its group before
    # its fence read the verdict: counted alive, the plan kept it and the group was refused)
    assert [e["rank"] for e in events if e["event"] == "released" and e["replica"] == 1] == [0]
    # nobody restarted in place: not the evicted rank, and so not its sibling either (no new rendezvous round)
    assert not [e for e in events if e["event"] == "worker_start" and e["restart"] > 0], \
        [e for e in events if e["event"] == "worker_start"]
    assert (lost["why"], lost["alive"], lost["applied"]) == ("rank lost", [0], "shrink"), lost
    heals = [e for e in events if e["event"] == "heal" and e["side"] == "joiner" and e.get("shrunk")]
    assert sorted(e["rank"] for e in heals) == [0, 1] and {e["replica"] for e in heals} == {1}
    record = steps(events)
    assert sorted(record) == list(range(STEPS))
    after = events[events.index(dead):]
    assert [e for e in after if e["event"] == "step" and e["owners"].get("1")], \
        {s: record[s]["owners"] for s in record}  # the stand-in computed later steps
    (m,) = [e for e in measured(events, 1) if e["applied"] == "shrink"]
    assert m["measured_weight"] > slow["speed"], (m, slow)  # faster shrunk than slow in full
    assert all(sorted(i for mbs in record[s]["owners"].values() for i in mbs) == list(range(M)) for s in record)
    assert audit(out, M) == []
    cfg = Config.from_json((out / "config.json").read_text())
    want, _, _ = plain_loop(cfg, split=False, digest=staged(2))
    assert [digests(out)[s] for s in range(STEPS)] == want
