"""policy.corruption: the majority vote over digests that must agree, when state checks run, and the count
of times a device was found wrong with its eviction threshold (property tests)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.policy.corruption import Suspects, Verdict, checkers, recomputed, state_check_due, vote


def test_one_flipped_group_of_three_or_more_is_outvoted_and_healed_by_the_lowest_agreeing():
    assert vote({0: "a", 1: "a", 2: "b"}) == Verdict("a", (2,), 0)
    assert vote({3: "x", 5: "y", 7: "y", 9: "y"}) == Verdict("y", (3,), 5)
    assert vote({0: "a", 1: "a", 2: "a"}) == Verdict("a", (), 0)


def test_no_strict_majority_is_a_split_nobody_is_outvoted():
    for digests in ({0: "a", 1: "b"}, {0: "a", 1: "a", 2: "b", 3: "b"}, {0: "a", 1: "b", 2: "c"}):
        v = vote(digests)
        assert v.split and v.wrong == () and v.donor is None
    assert vote({}).wrong == () and vote({4: "a"}) == Verdict("a", (), 4)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 64), st.sampled_from("abc"), min_size=1, max_size=12))
def test_the_verdict_is_a_strict_majority_and_its_complement(digests):
    v = vote(digests)
    if v.split:
        assert max(list(digests.values()).count(d) for d in set(digests.values())) * 2 <= len(digests)
        return
    holders = [m for m, d in digests.items() if d == v.agreed]
    assert 2 * len(holders) > len(digests)
    assert set(v.wrong) == set(digests) - set(holders) and list(v.wrong) == sorted(v.wrong)
    assert v.donor == min(holders) and v.donor not in v.wrong
    assert vote(dict(reversed(list(digests.items())))) == v  # the same verdict whatever order members read


def test_state_checks_run_after_every_nth_step_and_never_at_zero():
    assert [s for s in range(12) if state_check_due(s, 4)] == [3, 7, 11]
    assert all(state_check_due(s, 1) for s in range(5))
    assert not any(state_check_due(s, 0) for s in range(20))


@given(st.lists(st.sampled_from(["g0r0", "g1r0", "g2r1"]), max_size=20), st.integers(0, 4))
def test_a_device_is_evicted_once_at_its_nth_finding(findings, after):
    s = Suspects()
    evicted = []
    for device in findings:
        s, evict = s.found(device, after)
        if evict:
            evicted.append(device)
    for device in set(findings):
        n = findings.count(device)
        assert s.counts[device] == n
        assert evicted.count(device) == (1 if 0 < after <= n else 0)
    assert s.evicted == tuple(evicted)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 256), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_recomputed_microbatches_are_a_pure_draw_of_the_step(step, m, fraction, seed):
    chosen = recomputed(step, m, fraction, seed)
    assert chosen == recomputed(step, m, fraction, seed) and list(chosen) == sorted(set(chosen))
    assert all(0 <= i < m for i in chosen)
    assert set(recomputed(step, m, fraction / 2, seed)) <= set(chosen)  # a smaller fraction: a subset
    assert recomputed(step, m, 0.0, seed) == () and recomputed(step, m, 1.0, seed) == tuple(range(m))


def test_the_recomputed_fraction_is_the_fraction_asked():
    drawn = sum(len(recomputed(s, 64, 1 / 16)) for s in range(2000))
    assert abs(drawn / (2000 * 64) - 1 / 16) < 0.005  # 128,000 draws: sd 0.0007


@given(st.sets(st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 100))
def test_checkers_are_other_members_spread_by_microbatch(members, i):
    members = tuple(sorted(members))
    owner = members[i % len(members)]
    got = checkers(owner, members, i)
    assert owner not in got and set(got) <= set(members) and len(set(got)) == len(got) == min(2, len(members) - 1)
