"""Which rank of a replica group is slow, from its ranks' own device times beside its peer groups'.

Owns: `rank_speeds` (each rank's speed relative to the same rank of the other groups, over recent committed
steps) and `slow_ranks` (those the scheduler is told are slow). Does not own: declaring a group Slow (the
detector, detection.py, which reads each group's slowest rank: `MicrobatchTiming.seconds`), or what is
done about it (scheduling.py).

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


def slow_ranks(speeds: Mapping[int, float]) -> dict[int, float]:
    """The ranks of `speeds` (rank_speeds) below SLOW_BELOW: what the scheduler is told is slow."""
    return {j: v for j, v in speeds.items() if v < SLOW_BELOW}
