"""Which rank of a replica group is slow, from its ranks' own device times beside its peer groups'.

Owns: `rank_speeds` (each rank's speed relative to the same rank of the other groups, over recent committed
steps) and `slow_ranks` (those the scheduler is told are slow). Does not own: declaring a group Slow (the
detector, detection.py, which reads each group's slowest rank: `MicrobatchTiming.seconds`), or what is
done about it (policy/replan_scheduler.py).

Why against the same rank of the peer groups: the ranks of one group do different work (a pipeline's
first stage holds the embedding, its last the head; an FSDP rank's share of a microbatch is its own rows),
while rank j of every group does the same work for the same plan. Why per token: groups hold different
microbatches each step; a rank's seconds per token over a few steps compare across groups as the
detector's speeds do (the quadratic attention term is left out: over several steps and groups it
averages, and a slow device shows as a factor, not a few percent).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from unbroken.policy.predictor import MicrobatchTiming

SLOW_BELOW = 0.7  # a rank below this speed against its peers is located as the slow one. Measured on 2
# shared CPU cores, failure-free runs of 2 groups x 2 ranks (TP, PP and HSDP, 16 steps, windows of 4 steps
# from step 6): 1 of 120 healthy ranks' ratios below 0.7 (0.65), 7 below 0.8; a TP rank 3x slow (spin)
# read 0.26-0.30. Below it the group is not located, and every rank gets the group's speed, as before.

Steps = Sequence[Mapping[int, Sequence[MicrobatchTiming]]]  # committed steps' timings, group -> microbatches


def _per_token(group: int, steps: Steps, ranks: int) -> list[float] | None:
    """Rank j's own device seconds per token of `group` over `steps`, or None without per-rank times."""
    seconds, tokens = [0.0] * ranks, 0
    for timings in steps:
        for m in timings.get(group, ()):
            if len(m.ranks) != ranks:
                return None  # a stand-in (one rank for the group) or a changed plan: not comparable
            seconds = [a + b for a, b in zip(seconds, m.ranks)]
            tokens += m.tokens
    return [s / tokens for s in seconds] if tokens else None


def rank_speeds(group: int, steps: Steps) -> dict[int, float]:
    """Each rank j of `group`: the median over its peer groups of their rank j's device seconds per token,
    over its own, capped at 1.0 (a rank is never located as fast). {} where `group` has no per-rank
    times in `steps` or no peer group has them for as many ranks. Pure; call at a verdict."""
    ranks = next((len(m.ranks) for t in steps for m in t.get(group, ())), 0)
    if ranks < 2:
        return {}
    own = _per_token(group, steps, ranks)
    groups = {g for t in steps for g in t} - {group}
    peers = [p for p in (_per_token(g, steps, ranks) for g in sorted(groups)) if p is not None]
    if own is None or not peers:
        return {}
    return {j: min(1.0, statistics.median(p[j] for p in peers) / own[j]) if own[j] > 0 else 1.0
            for j in range(ranks)}


BOUNDING = 0.5  # a rank below SLOW_BELOW is located only where its excess time (1/speed - 1) is at least this
# share of its group's slowest rank's: the ranks that bound the group's speed. Why: a slow rank's siblings
# take part of its slowness whenever they share something with it. On 2 shared CPU cores the spinning rank
# slows its sibling's kernels (an HSDP sibling can read 0.7 beside a 0.26 rank: both
# below SLOW_BELOW, excess 0.43 against 2.88; TP siblings 1.10-1.41x slow beside 2.4-3.4x); on a GPU a rank waiting inside a
# group collective's kernel for a slow peer counts that wait as device time. Evicting the bounding rank
# leaves the group at its next rank's speed, which the detector judges afresh; evicting a sibling for a
# share of its peer's slowness would shrink the group around a healthy device.


def slow_ranks(speeds: Mapping[int, float]) -> dict[int, float]:
    """The ranks of `speeds` (rank_speeds) below SLOW_BELOW that bound their group's speed (BOUNDING):
    what the scheduler is told is slow. Pure."""
    below = {j: v for j, v in speeds.items() if v < SLOW_BELOW}
    if not below:
        return {}
    excess = {j: 1 / max(v, 1e-9) - 1 for j, v in below.items()}
    worst = max(excess.values())
    return {j: below[j] for j, x in excess.items() if x >= BOUNDING * worst}
