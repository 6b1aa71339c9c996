"""Re-planning a replica group: plans cover every layer once, quotas keep every microbatch, the choice is
never predicted worse than dropping the group, shrinking stays within the survivors, and a group whose
ranks are all back and healthy returns to its full plan."""
from __future__ import annotations

import math
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.policy import replan_plans as P
from unbroken.policy import replan_scheduler as S
from unbroken.policy import stepcost as C
from unbroken.policy.predictor import CostModel
from unbroken.topology import Topology, TopologyError

GIB = 2 ** 30


def setting(full: P.Plan, mb_seconds: float = 0.5, microbatches: int = 64, budget: float = 60e9,
            state_per_layer: float = 13.76e9) -> C.Setting:
    # a 70B-like block: 0.86e9 parameters x 16 B of state; hidden 8192 in bf16
    model = C.ModelShape(full.layers, state_per_layer, 8192 * 2)
    return C.calibrate(mb_seconds, full, model, C.Hardware(state_budget_bytes=budget), 16384, microbatches, 0.3)


def resihp_group() -> tuple[P.Plan, C.Setting]:
    full = P.full_plan(Topology(8, 32, 8, tp=8, pp=4), 80)
    return full, setting(full)


def test_topology_degrees_add_up_and_default_to_one():
    t = Topology(2, 16, 8, tp=4, pp=2)
    assert (t.dp_shard, t.coords(0), t.coords(5), t.coords(13)) == (2, (0, 0, 0), (0, 1, 1), (1, 1, 1))
    assert Topology(3, 4, 4).dp_shard == 4 and Topology(3, 4, 4).coords(3) == (0, 3, 0)
    with pytest.raises(TopologyError, match="multiple of tp=3"):
        Topology(2, 8, 8, tp=3)


def test_full_plan_and_its_checks():
    full = P.full_plan(Topology(1, 8, 8, tp=2, pp=4), 10)
    assert full.stages == (3, 3, 2, 2) and full.teams[1] == (2, 3) and full.layer_ranges()[1] == range(3, 6)
    # FSDP2 inside the stages: each stage's team is its shards of a TP team, TP innermost (topology.coords)
    fsdp = P.full_plan(Topology(1, 8, 8, tp=2, pp=2), 10)
    assert (fsdp.tp, fsdp.shard, fsdp.teams) == (2, 2, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert fsdp.shape() == "tp2 pp2 [5,5] fsdp2" and full.shape() == "tp2 pp4 [3,3,2,2]"
    with pytest.raises(ValueError, match="tp x shard = 1 x 2"):
        P.Plan(1, (2,), ((0,),), shard=2)
    with pytest.raises(ValueError, match="one stage only"):
        P.Plan(1, (1, 1), ((0,), (0,)))
    with pytest.raises(ValueError, match=">= 1 layer"):
        P.Plan(2, (0, 2), ((0, 1), (2, 3)))


def test_calibration_reproduces_the_measured_microbatch_time():
    full, s = resihp_group()
    assert C.bottleneck(full, {}, s) == pytest.approx(0.5)
    assert C.group_seconds(full, 8, {}, s) == pytest.approx((8 + 3) * 0.5)  # bubble: pp-1 slots
    with pytest.raises(ValueError, match="communication"):
        setting(full, mb_seconds=0.01)


def test_fsdp2_gathers_overlap_the_compute_and_a_survivor_computes_every_shard_without_them():
    """A group of 4 FSDP2 shards: each layer's weights are all-gathered twice a microbatch (forward and
    backward) while the layer before computes, so a layer takes the larger of the two; the one rank that
    stands in for the group computes 4x the rows, with nothing to gather. A slow rank whose compute falls
    behind the gathers sets the pace; a measured time the gathers alone exceed cannot be calibrated."""
    full = P.full_plan(Topology(2, 4, 4), 8)
    s = C.calibrate(1.0, full, C.ModelShape(8, 16e9, 0.0, 2e9), C.Hardware(), 4096, 16)
    gathers = C.fsdp_comm(1, 4, s)
    assert gathers == pytest.approx(2 * 0.75 * 2e9 / C.Hardware().tp_bytes_per_s) and gathers < 1.0 / 8
    assert C.bottleneck(full, {}, s) == pytest.approx(1.0)  # compute-bound: the gathers hidden
    assert C.bottleneck(P.Plan(1, (8,), ((2,),)), {}, s) == pytest.approx(4.0)
    assert C.bottleneck(full, {3: 0.5}, s) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="FSDP2 gathers"):
        C.calibrate(8 * gathers, full, C.ModelShape(8, 16e9, 0.0, 2e9), C.Hardware(), 4096, 16)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda pp: st.tuples(
    st.integers(pp, 14), st.lists(st.floats(0.1, 3.0), min_size=pp, max_size=pp),
    st.lists(st.floats(0.0, 1.0), min_size=pp, max_size=pp), st.lists(st.integers(1, 8), min_size=pp, max_size=pp))))
def test_partition_is_optimal_within_capacity(args):
    layers, per_layer, fixed, cap = args
    got = P.partition(layers, per_layer, fixed, cap)
    feasible = [c for c in product(*(range(1, k + 1) for k in cap)) if sum(c) == layers]
    if not feasible:
        assert got is None
        return
    def cost(c):
        return max(f + n * p for n, p, f in zip(c, per_layer, fixed))
    assert sum(got) == layers and all(1 <= n <= k for n, k in zip(got, cap))
    assert cost(got) <= min(cost(c) for c in feasible) + 1e-12


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1), (1, 1)])
def test_two_groups_of_two_ranks_shrink_to_one_rank_at_half_speed(tp, pp):
    """The runtime's case: 2 groups x (PP 2, TP 2 or FSDP2 2), rank 1 of group 0 lost. With no communication cost
    the survivor runs the whole model at half the pair's speed, takes a third of the microbatches, and the
    step is 2/3 of dropping the group (3 of 4 ranks busy instead of 2) less the pipeline's bubble."""
    full = P.full_plan(Topology(2, 2, 2, tp=tp, pp=pp), 4)
    model = C.ModelShape(4, 1e9, 0.0)  # no activation traffic: compute alone
    s = C.calibrate(1.0, full, model, C.Hardware(state_budget_bytes=8e9), 4096, 12)
    d = S.decide(0, {0: full, 1: full}, full, {0}, {}, s, horizon_steps=math.inf)
    drop = next(o for o in d.options if o.kind == "drop")
    assert d.chosen.kind == "shrink" and d.chosen.plan.teams == ((0,),) and d.chosen.plan.stages == (4,)
    assert d.chosen.plan.weight == pytest.approx(0.5) and d.chosen.owners.count(0) == 4
    # drop: group 1 pipelines all 12 (12 + pp-1 slots of 1 s); shrink: group 0 runs 4 at 2 s, group 1 8
    assert drop.step_seconds == pytest.approx(12 + pp - 1)
    assert d.chosen.step_seconds == pytest.approx(max(8 + pp - 1, 4 * 2))  # 1.5x for TP, 13/9 for PP
    # rank 0 missed the step it lost its peer in: it pulls the whole model's state from the peer group,
    # its own stage's too; a live shrunk group growing back pulls only what the returning rank lacks
    assert d.chosen.moved_bytes == pytest.approx(4e9)
    back = S.decide(0, {0: d.chosen.plan, 1: full}, full, {0, 1}, {}, s, horizon_steps=math.inf)
    assert back.chosen.kind == "grow" and back.chosen.moved_bytes == pytest.approx(2e9)


def test_the_predictors_cost_model_sets_the_microbatch_time():
    """The runtime calibrates with the predictor's fit: seconds of one microbatch of its tokens and
    sum of squared lengths on a healthy group's full plan."""
    full = P.full_plan(Topology(2, 2, 2, pp=2), 8)
    cost = CostModel(a=2e-5, b=1e-9, c=0.01)
    per_mb = cost.predict(4096, 4 * 1024 ** 2)
    s = C.calibrate(per_mb, full, C.ModelShape(8, 1e9, 2048.0), C.Hardware(), 4096, 16)
    assert C.bottleneck(full, {}, s) == pytest.approx(per_mb)
    assert C.bottleneck(full, {1: 0.5}, s) > 1.9 * per_mb  # a 2x slow rank on stage 1 nearly doubles it


def test_a_lost_host_shrinks_the_pipeline_and_grows_back():
    full, s = resihp_group()
    plans = {g: full for g in range(8)}
    d = S.decide(0, plans, full, set(range(8, 32)), {}, s, horizon_steps=600)
    drop = next(o for o in d.options if o.kind == "drop")
    assert d.chosen.kind == "shrink" and d.chosen.plan.tp == 8 and d.chosen.plan.pp == 3
    assert d.chosen.plan.ranks == frozenset(range(8, 32)) and d.chosen.step_seconds < drop.step_seconds
    # each surviving rank missed the step the host was lost in: it pulls its whole new holding (its TP
    # slice of its stage's layers): together the 3 stages' 24 ranks pull the whole model's state once
    assert d.chosen.moved_bytes == pytest.approx(80 * s.model.state_bytes_per_layer)
    assert d.chosen.replan_seconds > s.hardware.reform_seconds
    back = S.decide(0, {**plans, 0: d.chosen.plan}, full, set(range(32)), {}, s, horizon_steps=600)
    assert back.chosen.kind == "grow" and back.chosen.plan == full
    rec = back.record()
    assert rec["decision"] == "grow" and rec["plan"] == "tp8 pp4 [20,20,20,20]" and [o["kind"] for o in rec["options"]] == ["drop", "grow"]


def test_a_slow_rank_gets_layers_moved_off_its_stage():
    full, s = resihp_group()
    plans = {g: full for g in range(8)}
    d = S.decide(0, plans, full, set(range(32)), {0: {5: 0.25}}, s, horizon_steps=900)
    kinds = {o.kind: o for o in d.options}
    assert {"drop", "keep", "reweight", "repartition", "shrink"} <= set(kinds)
    assert d.chosen.kind == "repartition" and d.chosen.plan.stages[0] < min(d.chosen.plan.stages[1:])
    assert d.chosen.amortised_seconds < kinds["keep"].amortised_seconds  # doing nothing costs most


def test_no_peer_group_and_state_no_survivor_holds_leaves_only_drop():
    full, s = resihp_group()
    d = S.decide(0, {0: full}, full, set(range(8, 32)), {}, s, horizon_steps=600, peers=False)
    assert [o.kind for o in d.options] == ["drop"] and math.isinf(d.chosen.step_seconds)
    with pytest.raises(ValueError, match="horizon"):
        S.decide(0, {0: full}, full, set(range(32)), {}, s, horizon_steps=0)


@st.composite
def situations(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 4))
    shard = draw(st.sampled_from([1, 1, 2]))  # FSDP2 inside the stages, now and then
    size = tp * pp * shard
    layers = draw(st.integers(pp, 12))
    groups = draw(st.integers(1, 4))
    microbatches = draw(st.integers(groups, 24))
    full = P.full_plan(Topology(groups, size, size, tp=tp, pp=pp), layers)
    # state budget between 1 and 3 full stages' worth per rank: some shrinks do not fit
    per_layer_state = 1e9
    budget = draw(st.floats(1.0, 3.0)) * per_layer_state * max(full.stages) / tp
    model = C.ModelShape(layers, per_layer_state, draw(st.sampled_from([0.0, 1024.0, 16384.0])),
                         draw(st.sampled_from([0.0, per_layer_state / 8])))
    hw = C.Hardware(state_budget_bytes=budget, reform_seconds=draw(st.floats(0.0, 5.0)))
    s = C.Setting(model, hw, C.Work(draw(st.floats(0.1, 50.0)), 4096, microbatches, draw(st.floats(0.0, 1.0))))
    alive = draw(st.sets(st.sampled_from(range(size)), max_size=size))
    speeds = draw(st.dictionaries(st.sampled_from(range(size)), st.floats(0.1, 1.0), max_size=3))
    current = draw(st.sampled_from([full, None]))
    plans = {g: full for g in range(1, groups)} | ({0: current} if current else {})
    horizon = draw(st.sampled_from([1.0, 10.0, 1000.0, math.inf]))
    return full, s, plans, frozenset(alive), speeds, horizon, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(situations())
def test_every_option_keeps_the_batch_and_the_choice_never_loses_to_drop(case):
    full, s, plans, alive, speeds, horizon, peers = case
    d = S.decide(0, plans, full, alive, {0: speeds}, s, horizon, peers)
    drop = next(o for o in d.options if o.kind == "drop")
    assert d.chosen in d.options and d.chosen.amortised_seconds <= drop.amortised_seconds
    for o in d.options:
        groups = set(plans) - {0} | ({0} if o.plan else set())
        # constant microbatches: every (s, i) owned by exactly one group of the step, none left out
        if groups:
            assert len(o.owners) == s.work.microbatches and set(o.owners) <= groups
            assert math.isfinite(o.step_seconds)
        else:  # nobody left to compute: no step at all, never a smaller batch
            assert o.owners == () and math.isinf(o.step_seconds)
        if o.plan is None:
            continue
        # layers covered once, in order; only surviving ranks; state within each rank's budget
        assert [layer for r in o.plan.layer_ranges() for layer in r] == list(range(full.layers))
        assert o.plan.ranks <= alive and o.plan.tp <= full.tp and o.plan.pp <= full.pp
        state = max(o.plan.stages) * s.model.state_bytes_per_layer / o.plan.tp / o.plan.shard
        assert o.kind == "keep" or state <= s.hardware.state_budget_bytes * (1 + 1e-9)
        if o.kind == "shrink":
            assert len(o.plan.ranks) < len(plans[0].ranks)


@settings(max_examples=200, deadline=None)
@given(situations())
def test_all_ranks_back_and_healthy_restores_the_full_plan(case):
    full, s, plans, alive, speeds, horizon, peers = case
    shrunk = S.decide(0, plans, full, alive, {0: speeds}, s, horizon, peers).chosen.plan
    back = {**plans, 0: shrunk} if shrunk else {g: p for g, p in plans.items() if g != 0}
    d = S.decide(0, back, full, full.ranks, {}, s, math.inf, peers=True)
    assert d.chosen.plan == full


RUNTIME_REFUSES = {"drop": "no parking", "repartition": "no re-form", "shrink": "no re-form", "grow": "no re-form"}


def test_restrict_applies_the_best_executable_option_and_says_why_the_others_were_not():
    """A rank of a PP 4 x TP 8 group at a quarter speed: the scheduler moves layers off it (repartition),
    but an executor that can only keep or reweight applies reweight, with the group's quota weight its
    predicted rate, and lists every refused kind that was a candidate."""
    full, s = resihp_group()
    d = S.decide(0, {0: full, 1: full}, full, full.ranks, {0: {9: 0.25}}, s, horizon_steps=1000)
    r = S.restrict(d, RUNTIME_REFUSES)
    assert d.chosen.kind not in ("keep", "reweight")  # the full scheduler would re-plan the group
    assert r.applied.kind == "reweight" and r.applied.plan.weight < 1.0
    assert r.applied.plan.weight == pytest.approx(C.rate(full, {9: 0.25}, full, s))
    keep = next(o for o in d.options if o.kind == "keep")
    assert r.applied.step_seconds < keep.step_seconds  # reweighting is predicted to pay
    candidates = {o.kind for o in d.options}
    rec = r.record()
    assert set(rec["not_executable"]) == candidates & set(RUNTIME_REFUSES) and "drop" in rec["not_executable"]
    assert rec["applied"] == "reweight" and rec["decision"] == d.chosen.kind and len(rec["options"]) == len(d.options)
    # the applied option's owners: one group per microbatch of the step, both groups still working
    assert len(r.applied.owners) == s.work.microbatches and set(r.applied.owners) == {0, 1}
    assert r.applied.owners.count(0) < r.applied.owners.count(1)  # the slow group holds fewer


def test_restrict_keeps_a_healthy_group_and_refuses_nonsense():
    full, s = resihp_group()
    d = S.decide(0, {0: full, 1: full}, full, full.ranks, {}, s, horizon_steps=10)
    assert S.restrict(d, RUNTIME_REFUSES).applied.kind == "keep"
    with pytest.raises(ValueError, match="unknown"):
        S.restrict(d, {"teleport": "?"})
    with pytest.raises(ValueError, match="no executable"):
        S.restrict(d, {"keep": "x", "drop": "y"})


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 7), st.sampled_from([0.1, 0.25, 0.5, 0.9]), st.integers(0, 3))
def test_restricted_choice_keeps_every_microbatch_and_never_beats_the_free_choice(slow, speed, other):
    """Whatever rank is slow: the applied option assigns each of the M microbatches to one group, and it is
    never predicted better than the unrestricted choice (it is chosen among fewer)."""
    full = P.full_plan(Topology(4, 8, 8, tp=2, pp=4), 16)
    s = setting(full, microbatches=12)
    plans = {g: full for g in range(4)}
    d = S.decide(other, plans, full, full.ranks, {other: {slow: speed}}, s, horizon_steps=50)
    r = S.restrict(d, RUNTIME_REFUSES)
    assert r.applied.kind in ("keep", "reweight")
    assert len(r.applied.owners) == 12 and set(r.applied.owners) <= set(plans)
    assert r.applied.amortised_seconds >= d.chosen.amortised_seconds


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=7).flatmap(lambda full: st.tuples(
    st.just(full), st.integers(1, len(full)).flatmap(lambda k: st.tuples(
        st.just(k), st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=k, max_size=k),
        st.lists(st.floats(0, 1), min_size=k, max_size=k), st.lists(st.integers(1, 12), min_size=k, max_size=k))))))
def test_coarsen_finds_the_best_split_into_merged_full_stages(case):
    """plans.coarsen against every way to cut the full plan's stages into k runs: the same least bottleneck
    (or None exactly where no cut fits the capacities), and each stage a union of whole full stages."""
    from itertools import combinations

    full, (k, per, fixed, cap) = case
    best = None
    for cuts in combinations(range(1, len(full)), k - 1):
        b = (0, *cuts, len(full))
        stages = [sum(full[b[i]:b[i + 1]]) for i in range(k)]
        if all(stages[i] <= cap[i] for i in range(k)):
            t = max(fixed[i] + stages[i] * per[i] for i in range(k))
            best = t if best is None else min(best, t)
    got = P.coarsen(full, k, per, fixed, cap)
    if best is None:
        assert got is None
        return
    assert got is not None and len(got) == k and sum(got) == sum(full)
    assert math.isclose(max(fixed[i] + got[i] * per[i] for i in range(k)), best, abs_tol=1e-12)
    plan = P.Plan(1, got, tuple((r,) for r in range(k)))
    assert P.aligned(plan, P.Plan(1, tuple(full), tuple((r,) for r in range(len(full)))))
