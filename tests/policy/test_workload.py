"""Quotas, assignment and redistribution: every microbatch has exactly one live owner."""
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.policy import workload

weights_st = st.dictionaries(st.integers(0, 15), st.floats(0.05, 4.0), max_size=16)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 64), st.sets(st.integers(0, 15), min_size=1), weights_st)
def test_quotas_sum_to_total_and_follow_weights(total, members, weights):
    q = workload.quotas(total, members, weights)
    assert sum(q.values()) == total and set(q) == members
    w = {m: weights.get(m, 0) for m in members}
    if all(v > 0 for v in w.values()):
        wsum = sum(w.values())
        for m in members:  # largest remainder: within one of the exact share
            assert abs(q[m] - total * w[m] / wsum) < 1 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.data())
def test_redistribution_keeps_survivors_work_and_covers_orphans(m, r, data):
    members = list(range(r))
    owners = workload.assign(m, members)
    history = []
    alive = set(members)
    while len(alive) > 1 and data.draw(st.booleans()):
        dead = data.draw(st.sets(st.sampled_from(sorted(alive)), min_size=1, max_size=len(alive) - 1))
        alive -= dead
        history.append(sorted(alive))
    new = workload.replay(owners, history)
    assert len(new) == m and set(new) <= alive
    for i, o in enumerate(owners):
        if o in alive:  # a survivor's own work stays where it is: no recompute
            assert new[i] == o


def test_loss_weights_sum_to_one():
    tokens = [37, 256, 1, 90]
    assert abs(sum(workload.loss_weight(t, sum(tokens)) for t in tokens) - 1) < 1e-12


def test_replanning_waits_for_a_real_gain():
    members = [0, 1, 2, 3]
    half = {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5}
    # 28 microbatches: equal quotas (7 each) under a 2x slow replica take 14 units; 8,8,8,4 take 8
    assert workload.makespan(workload.assign(28, members, half), half) == 8.0
    assert workload.worth_replanning(28, members, {}, half)
    # jitter of the slow replica's estimate near a rounding boundary moves nothing (at 0.38 one
    # microbatch less is a real gain: 3 / 0.38 = 7.9 < 4 / 0.38 = 10.5)
    for jitter in (0.44, 0.47, 0.52, 0.55):
        assert not workload.worth_replanning(28, members, half, {**half, 3: jitter})
    # recovery to full speed is worth it: 8 units -> 7
    assert workload.worth_replanning(28, members, half, {m: 1.0 for m in members})
    # a tiny fleet change in membership never divides by zero
    assert not workload.worth_replanning(0, [], half, {})


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.sets(st.integers(0, 11), min_size=1), weights_st, st.data())
def test_a_parked_member_owns_nothing_while_any_other_member_can_take_the_work(m, members, weights, data):
    """Weight PARKED (ResiHP's drop of a Slow group): no microbatch, while every microbatch still has
    exactly one owner; if every member is parked the work is shared as if none were."""
    parked = data.draw(st.sets(st.sampled_from(sorted(members))))
    w = {**weights, **{p: workload.PARKED for p in parked}}
    owners = workload.assign(m, sorted(members), w)
    assert len(owners) == m and set(owners) <= members
    if parked != members:
        assert not parked & set(owners)
        active = members - parked
        if m >= len(active):  # the others keep at least one each, as before
            assert active <= set(owners)
    else:
        assert owners == workload.assign(m, sorted(members))
    survivors = sorted(members - {min(members)}) or None
    if survivors:  # a lost owner's microbatches go to the survivors that are not parked, if any is not
        moved = workload.redistribute(owners, survivors, w)
        orphaned = [i for i, o in enumerate(owners) if o not in survivors]
        if set(survivors) - parked:
            assert not {moved[i] for i in orphaned} & parked
