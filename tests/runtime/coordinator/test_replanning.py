"""The coordinator's re-planning step without processes: verdict changes in, `group_plan` events and quota
weights out (runtime/coordinator/replan.py). The torchrun path is tests/runtime/coordinator/test_slow_pp.py."""
from __future__ import annotations

from dataclasses import replace

from unbroken.events import EventLog, read_events
from unbroken.policy.detection import Verdict, VerdictChange
from unbroken.policy.predictor import MicrobatchTiming, Predictor
import pytest

from unbroken.policy.workload import PARKED
from unbroken.runtime.coordinator.replan import DROP, EQUAL, MULTI_RANK, GroupShape, planner_for, reformable

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


def test_groups_without_a_shape_are_not_planned_and_fsdp2_groups_are(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    assert planner_for(None, 2, log, "speed") is None
    fsdp = GroupShape(group_size=4, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=20)
    planner = planner_for(fsdp, 2, log, "speed")
    assert planner.full.shape() == "tp1 pp2 [1,1] fsdp2" and planner.full.teams == ((0, 1), (2, 3))


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


def ranked(slow_rank: int | None, factor: float = 3.0) -> dict[int, list[MicrobatchTiming]]:
    """A committed step of 2 pipeline groups: each rank 2 ms a microbatch of its own, group 1's `slow_rank`
    `factor` x that (the group's time its slowest rank's, as slowness.group_timings makes it)."""
    out = {}
    for g in (0, 1):
        ranks = tuple(0.002 * (factor if g == 1 and j == slow_rank else 1.0) for j in range(2))
        out[g] = [MicrobatchTiming(256, 16384.0, max(ranks), ranks)] * 4
    return out


@pytest.mark.parametrize("evict, quotas, applied", [(1, "speed", "shrink"), (0, "speed", "reweight"),
                                                    (1, "equal", "keep")])
def test_a_located_slow_rank_is_evicted_where_its_group_can_shrink(tmp_path, evict, quotas, applied):
    """Rank 1 of group 1 3x slow: located against rank 1 of group 0; with a cheap re-form the scheduler
    prefers one healthy rank running the whole model (speed 1/2) to the group at 1/3. Under
    parallel.on_rank_loss=replan (evict) and speed quotas that is executed as rank 1's loss: the
    coordinator declares group 1 dead for it, naming it, and its survivor asks to go on shrunk. Otherwise
    the runtime reweights (or, under equal quotas, keeps), as before."""
    log = EventLog(tmp_path / "events.jsonl")
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=200,
                       reform_seconds=0.01, evict=evict)
    planner = planner_for(shape, 2, log, quotas=quotas)
    for step in range(3):
        planner.on_verdicts([], ranked(1), Predictor(), [0, 1])
    planner.on_verdicts(changes(3, Verdict.SLOW, Verdict.SUSPECT, 1 / 3), ranked(1), Predictor(), [0, 1])
    (e,) = read_events(tmp_path)
    assert e["located"] == [1] and e["rank_speeds"] == {"0": 1.0, "1": pytest.approx(1 / 3, abs=1e-3)}
    assert e["decision"] == "shrink" and e["applied"] == applied, e
    evicted = planner.evictions()
    assert evicted == ({1: "rank 1: evicted, slow (speed 0.33)"} if applied == "shrink" else {})
    assert planner.evictions() == {}  # handed over once
    assert ("shrink" in e["not_executable"]) == (applied != "shrink")


def test_a_group_that_cannot_re_form_is_priced_shrunk_and_dropped_saying_why(tmp_path):
    """GroupShape.reform_refused (a user's parallelize function sharded the group: api.check_host): a lost
    rank's group is priced as ever, the scheduler choosing to shrink it onto its survivor, but drop is
    applied and `not_executable` names the reason; a drop keeps the trajectory. Its located slow rank is
    never evicted (its survivor could not go on without it): reweighted. The reason reaches the
    coordinator's process beside --plan (plan_arg / parse_shape)."""
    from unbroken.api import CUSTOM_REFUSED
    from unbroken.runtime.coordinator.replan import parse_shape, plan_arg

    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=200,
                       reform_seconds=0.01, evict=1, reform_refused=CUSTOM_REFUSED)
    assert parse_shape(2, plan_arg(shape), CUSTOM_REFUSED) == shape and "parallelize" not in plan_arg(shape)
    assert parse_shape(2, plan_arg(shape)) == replace(shape, reform_refused=None)
    log = EventLog(tmp_path / "events.jsonl")
    r, e = rank_lost(tmp_path, log, shape, [0])
    assert (r.decision.chosen.kind, r.applied.kind) == ("shrink", "drop")
    assert (e["decision"], e["applied"], e["applied_plan"]) == ("shrink", "drop", None), e
    assert e["not_executable"]["shrink"] == CUSTOM_REFUSED and e["trajectory"].startswith("bitwise")
    planner = planner_for(shape, 2, log, quotas="speed")
    planner.on_verdicts([], ranked(1), Predictor(), [0, 1])
    planner.on_verdicts(changes(3, Verdict.SLOW, Verdict.SUSPECT, 1 / 3), ranked(1), Predictor(), [0, 1])
    e = read_events(tmp_path)[-1]
    assert (e["located"], e["applied"], e["not_executable"]["shrink"]) == ([1], "reweight", CUSTOM_REFUSED), e
    assert planner.evictions() == {}


def test_the_slow_rank_is_located_over_its_group_s_episode_not_the_warm_up_before_it(tmp_path):
    """Per-rank times of a CI run (d74a2a9, 2 groups x TP 2, microseconds a token): every rank's first step
    is a warm-up, group 0's rank 1 at 5x; group 1's rank 1 spins 3x from step 2, the group turns Suspect
    at step 2 and Slow at step 3. Over steps 0-3 the peer's warm-up hid it (0.92, nobody located); over
    the episode, steps 2-3, it reads 0.35 and is located."""
    log = EventLog(tmp_path / "events.jsonl")
    planner = planner_for(SHAPE, 2, log, quotas="speed")
    per_token = [((194, 342), (155, 165)), ((67, 66), (61, 59)), ((78, 60), (72, 167)), ((63, 65), (65, 190))]
    verdicts = [[], [], changes(2, Verdict.SUSPECT, Verdict.HEALTHY, 1.0), changes(3, Verdict.SLOW, Verdict.SUSPECT, 0.4)]
    for step, (us, change) in enumerate(zip(per_token, verdicts)):
        timings = {g: [MicrobatchTiming(256, 16384.0, max(r) * 256e-6, tuple(x * 256e-6 for x in r))] * 3
                   for g, r in enumerate(us)}
        planner.on_verdicts(change, timings, Predictor(), [0, 1])
    (e,) = read_events(tmp_path)
    assert e["located"] == [1], e
    assert e["rank_speeds"] == {"0": 1.0, "1": pytest.approx((60 + 65) / (167 + 190), abs=1e-3)}


def test_a_slow_group_with_no_rank_located_is_never_evicted(tmp_path):
    """Both ranks of group 1 slow alike: no rank stands out against its peer (rank_speeds 1/3 each, so both
    are below the bar: two located, which one healthy rank cannot replace): reweight, nobody evicted."""
    log = EventLog(tmp_path / "events.jsonl")
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=200,
                       reform_seconds=0.01, evict=1)
    planner = planner_for(shape, 2, log, quotas="speed")
    both = {0: ranked(None)[0], 1: [MicrobatchTiming(256, 16384.0, 0.006, (0.006, 0.006))] * 4}
    planner.on_verdicts(changes(3, Verdict.SLOW, Verdict.SUSPECT, 1 / 3), both, Predictor(), [0, 1])
    (e,) = read_events(tmp_path)
    assert e["located"] == [0, 1] and e["applied"] == "reweight" and planner.evictions() == {}


@pytest.mark.parametrize("speed, applied", [(0.55, "keep"), (0.2, "reweight")])
def test_a_shrunk_group_is_slow_only_below_what_its_plan_was_expected_to_give(tmp_path, speed, applied):
    """A group shrunk onto one rank runs the whole model: against full groups the detector finds it at about
    its plan's weight (~1/2) and may declare it Slow. Its device is slow only below that: at 0.55 it is
    kept on its plan (quota weight the plan's), at 0.2 (a device at 0.4) reweighted to the measured 0.2.
    Either way the decision is priced on the stand-in's one rank."""
    log = EventLog(tmp_path / "events.jsonl")
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=200,
                       reform_seconds=0.01, evict=1)
    planner = planner_for(shape, 2, log, quotas="speed")
    planner.on_verdicts([], ranked(None), Predictor(), [0, 1])
    planner.forget(1)  # its rank 1 lost: declared dead, its survivor asks to go on
    assert planner.on_rank_lost(1, [0], 4, [0], Predictor()).applied.kind == "shrink"
    weight = planner.weight_of(1, 1.0)
    assert 0.3 < weight < 0.7
    planner.on_verdicts(changes(8, Verdict.SLOW, Verdict.SUSPECT, speed), ranked(None), Predictor(), [0, 1])
    e = read_events(tmp_path)[-1]
    assert (e["why"], e["shrunk"], e["applied"]) == ("slow", True, applied), e
    assert e["device_speed"] == pytest.approx(min(1.0, speed / weight), abs=1e-4)
    assert all(o["plan"] in (None, "tp1 pp1 [2]") for o in e["options"])  # one rank: no two-rank plan
    assert planner.weight_of(1, speed) == (weight if applied == "keep" else speed)
    assert planner.evictions() == {}


def rank_lost(tmp_path, log: EventLog, shape: GroupShape, alive: list[int]):
    """(The restricted decision, its `group_plan` event) for group 1 of 2 under `shape` having lost a rank
    at step 4, `alive` its survivors that claimed, after a committed step of TIMINGS."""
    planner = planner_for(shape, 2, log, quotas="speed")
    planner.on_verdicts([], TIMINGS, Predictor(), [0, 1])
    planner.forget(1)
    r = planner.on_rank_lost(1, alive, 4, [0], Predictor())
    return r, read_events(tmp_path)[-1]


def test_several_survivors_re_form_only_a_pipeline_of_whole_stages(tmp_path):
    """2 stages x TP 2 (4 ranks), rank 3 lost, ranks 0-2 claimed: the scheduler's choice, executed, is the
    TP team of stage 0 running both stages (~1/2 of the group; its TP degree kept: bitwise). Ranks 0 and
    2 alone (no whole TP team): with 4 microbatches every shrink gives the group one microbatch a step and
    the smaller state pull decides, so the two re-form the stages without TP (TP 2 -> 1: within
    tolerance); a TP team of another degree is never offered (plans.teams: tp divides the full one's).
    3 stages (3 ranks), the middle one lost: its two survivors re-form 2 stages, one merging two of the
    full plan's stages, executed."""
    log = EventLog(tmp_path / "events.jsonl")
    shape = GroupShape(group_size=4, tp=2, pp=2, layers=2, width=64, microbatches=8, steps=20, reform_seconds=0.01)
    r, e = rank_lost(tmp_path, log, shape, [0, 1, 2])
    assert r.applied == r.decision.chosen and r.applied.plan.teams == ((0, 1),), r.applied
    assert (e["alive"], e["applied_plan"], e["applied_teams"]) == ([0, 1, 2], "tp2 pp1 [2]", [[0, 1]])
    assert not e["not_executable"] and e["trajectory"].startswith("bitwise"), e
    one = [o["weight"] for o in e["options"] if o["plan"] == "tp1 pp1 [2]"]
    assert e["applied_weight"] > 1.8 * one[0]  # the whole model on one rank: ~1/4
    _, e = rank_lost(tmp_path, log, replace(shape, microbatches=4), [0, 2])
    assert (e["applied_plan"], e["applied_teams"], e["trajectory"][:6]) == ("tp1 pp2 [1,1]", [[0], [2]], "within"), e
    assert not e["not_executable"], e
    three = GroupShape(group_size=3, tp=1, pp=3, layers=3, width=64, microbatches=8, steps=20, reform_seconds=0.01)
    r, _ = rank_lost(tmp_path, log, three, [0, 2])
    assert r.applied.kind == "shrink" and r.applied.plan.teams == ((0,), (2,)), r.applied.plan
    assert r.applied.plan.stages in ((2, 1), (1, 2))
    assert not any(k.startswith("shrink") for k in read_events(tmp_path)[-1]["not_executable"])


def test_fsdp2_pipelines_re_form_one_rank_or_one_tp_team_a_stage(tmp_path):
    """2 stages x 2 FSDP2 shards (4 ranks), rank 3 lost, ranks 0-2 claimed: two survivors re-form the two
    stages, one rank each (each holding both shards of its stage: ~1/2 of the group), executed and bitwise
    (the FSDP2 stages' tied-weight sum kept in float64: pipeline.Stages(apart=True)), nothing refused (a
    shrink has no FSDP2: policy/replan_scheduler.py; `reformable` would refuse one: the test below). 2 x 2 x TP 2 (8 ranks),
    rank 5 lost: the scheduler's choice, two whole TP teams one a stage (each rank holding both FSDP2
    shards of its TP index), executed, bitwise (the TP degree kept)."""
    log = EventLog(tmp_path / "events.jsonl")
    # 12 microbatches: with 8, one survivor's 2 a step at 1/4 speed tie with the pipeline's (measured 0.031958
    # s against 0.031979 s a step: the bubble), and the one survivor is rightly kept
    shape = GroupShape(group_size=4, tp=1, pp=2, layers=2, width=64, microbatches=12, steps=20, reform_seconds=0.01)
    r, e = rank_lost(tmp_path, log, shape, [0, 1, 2])
    assert r.applied.kind == "shrink" and [len(t) for t in r.applied.plan.teams] == [1, 1], r.applied
    assert (e["applied_plan"], e["trajectory"][:7]) == ("tp1 pp2 [1,1]", "bitwise"), e
    assert r.applied.plan.shard == 1 and r.applied == r.decision.chosen, r.applied
    assert not e["not_executable"], e
    one = [o["weight"] for o in e["options"] if o["plan"] == "tp1 pp1 [2]"]
    assert e["applied_weight"] > 1.8 * one[0]  # the whole model on one rank: ~1/4
    three_d = GroupShape(group_size=8, tp=2, pp=2, layers=2, width=64, microbatches=48, steps=20,
                         reform_seconds=0.01)
    r, e = rank_lost(tmp_path, log, three_d, [0, 1, 2, 3, 4, 6, 7])
    assert r.applied == r.decision.chosen and r.applied.plan.tp == 2 and r.applied.plan.pp == 2, r.applied
    assert all(len(team) == 2 and team[0] % 2 == 0 and team[1] == team[0] + 1 for team in r.applied.plan.teams)
    assert e["trajectory"].startswith("bitwise") and not e["not_executable"], e
    assert e["applied_weight"] > 1.8 * max(o["weight"] for o in e["options"] if o["plan"] == "tp1 pp1 [2]")


def test_reformable_refuses_exactly_the_plans_whose_slices_are_not_a_peer_s_shard_indices():
    """A full plan of 2 stages x 2 FSDP2 shards x TP 4 (16 ranks): one rank a stage and whole TP 4 teams
    are executable (each holds whole shard indices of its full stages); a TP 2 team (its slices would cut
    other heads than a TP 4 rank's), a team sharding with FSDP2 (other rows) and a split of layers that
    cuts a full stage are refused, each named."""
    from unbroken.policy.replan_plans import Plan
    from unbroken.policy.replan_scheduler import Option

    full = Plan(tp=4, stages=(2, 2), teams=(tuple(range(8)), tuple(range(8, 16))), shard=2)
    unable = reformable(full)

    def why(plan: Plan) -> str | None:
        return unable(Option("shrink", plan, 0.0, 0.0, 0.0, 0.0, ()))

    assert why(Plan(tp=1, stages=(2, 2), teams=((0,), (9,)))) is None
    assert why(Plan(tp=4, stages=(2, 2), teams=((0, 1, 2, 3), (8, 9, 10, 11)))) is None
    assert why(Plan(tp=4, stages=(4,), teams=((4, 5, 6, 7),))) is None
    assert why(Plan(tp=1, stages=(4,), teams=((3,),))) is None  # one rank: the stand-in
    assert why(Plan(tp=2, stages=(2, 2), teams=((0, 1), (8, 9)))) == MULTI_RANK
    assert why(Plan(tp=4, stages=(2, 2), teams=(tuple(range(8)), tuple(range(8, 16))), shard=2)) == MULTI_RANK
    assert why(Plan(tp=1, stages=(1, 3), teams=((0,), (9,)))) == MULTI_RANK  # cuts full stage 0
