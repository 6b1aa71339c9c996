"""policy/locating.py: which rank of a Slow replica group is the slow one, from its ranks' own device times
against the same rank of its peer groups (pure: synthetic timings)."""
from __future__ import annotations

from hypothesis import given, strategies as st

from unbroken.policy.locating import BOUNDING, SLOW_BELOW, rank_speeds, slow_ranks
from unbroken.policy.predictor import MicrobatchTiming


def step(groups: dict[int, tuple[float, ...]], tokens: int = 100, mbs: int = 3) -> dict[int, list[MicrobatchTiming]]:
    """One committed step: each group's `mbs` microbatches of `tokens`, rank j taking groups[g][j] s each
    per 100 tokens (a pipeline's stages differ: rank 1 here does twice rank 0's work)."""
    return {g: [MicrobatchTiming(tokens, tokens * 10.0, max(r) * tokens / 100, tuple(x * tokens / 100 for x in r))
                for _ in range(mbs)] for g, r in groups.items()}


def test_a_slow_last_stage_is_located_against_the_same_stage_of_its_peers():
    healthy, slow = (0.01, 0.02), (0.01, 0.06)  # rank 1 (the last stage) 3x slow in group 2
    steps = [step({0: healthy, 1: healthy, 2: slow}) for _ in range(4)]
    speeds = rank_speeds(2, steps)
    assert speeds[0] == 1.0 and abs(speeds[1] - 1 / 3) < 1e-9
    assert slow_ranks(speeds) == {1: speeds[1]}
    # the healthy groups: nothing located (a peer's slow rank raises the median of none of theirs)
    assert slow_ranks(rank_speeds(0, steps)) == {}


def test_per_token_so_groups_holding_different_microbatches_compare():
    steps = [{**step({0: (0.01, 0.02)}, tokens=50, mbs=4), **step({1: (0.01, 0.02)}, tokens=200, mbs=1)}]
    assert rank_speeds(1, steps) == {0: 1.0, 1: 1.0}


def test_nothing_to_compare_locates_nothing():
    one_rank = [{0: [MicrobatchTiming(100, 1.0, 0.01)], 1: [MicrobatchTiming(100, 1.0, 0.03)]}]
    assert rank_speeds(1, one_rank) == {}  # one-rank groups: no per-rank times
    alone = [step({1: (0.01, 0.06)})]
    assert rank_speeds(1, alone) == {}  # no peer group
    standin = [{0: step({0: (0.01, 0.02)})[0], 1: [MicrobatchTiming(100, 1.0, 0.05)]}]
    assert rank_speeds(1, standin) == {}  # a stand-in runs the group on one rank: not comparable
    assert rank_speeds(0, standin) == {}  # and is no peer for a group of two


def test_a_slowdown_shorter_than_the_window_is_diluted_not_missed():
    healthy, slow = (0.01, 0.02), (0.01, 0.06)
    steps = [step({0: healthy, 1: healthy})] * 2 + [step({0: healthy, 1: slow})] * 2
    speeds = rank_speeds(1, steps)
    assert abs(speeds[1] - 0.08 / 0.16) < 1e-9 and slow_ranks(speeds) == {1: speeds[1]}


@given(st.lists(st.floats(0.001, 1.0), min_size=2, max_size=4), st.floats(1.0, 10.0), st.integers(0, 3))
def test_speeds_are_at_most_one_and_only_the_slowed_rank_is_located(base, factor, which):
    which %= len(base)
    slowed = tuple(x * factor if j == which else x for j, x in enumerate(base))
    steps = [step({0: tuple(base), 1: tuple(base), 2: slowed})]
    speeds = rank_speeds(2, steps)
    assert all(0 < v <= 1.0 for v in speeds.values())
    assert abs(speeds[which] - 1 / factor) < 1e-9
    assert set(slow_ranks(speeds)) == ({which} if 1 / factor < SLOW_BELOW else set())


def test_a_sibling_slowed_by_its_slow_peer_is_not_located_but_two_slow_ranks_are():
    """The ranks that bound the group's speed are located; a sibling with a share of its slow peer's
    slowness (shared cores on one host; a GPU kernel waiting on it in a group collective) is not."""
    healthy = (0.01, 0.01)
    # measured in CI at 87d01b2 (HSDP, 2 shared cores): rank 1 spinning 3x read 0.258, its sibling 0.698
    sibling = [step({0: healthy, 1: (0.01 / 0.698, 0.01 / 0.258)}) for _ in range(4)]
    speeds = rank_speeds(1, sibling)
    assert speeds[0] < SLOW_BELOW and set(slow_ranks(speeds)) == {1}, speeds
    # two devices slow for good, 3x and 2.5x: the 2.5x rank's excess (1.5) is 3/4 of the 3x's (2.0)
    both = [step({0: healthy, 1: (0.025, 0.03)}) for _ in range(4)]
    assert set(slow_ranks(rank_speeds(1, both))) == {0, 1}
    # 4x and 1.6x: the 1.6x rank's excess (0.6) is a fifth of the 4x's (3.0): evict the 4x one first
    assert set(slow_ranks({0: 1 / 1.6, 1: 0.25})) == {1}


@given(st.dictionaries(st.integers(0, 7), st.floats(0.01, 1.0), min_size=1, max_size=8))
def test_the_slowest_rank_below_the_threshold_is_always_located(speeds):
    located = slow_ranks(speeds)
    assert set(located) <= {j for j, v in speeds.items() if v < SLOW_BELOW}
    if min(speeds.values()) < SLOW_BELOW:
        slowest = min(speeds, key=speeds.get)
        assert slowest in located
        assert all(1 / v - 1 >= BOUNDING * (1 / speeds[slowest] - 1) for v in located.values())
