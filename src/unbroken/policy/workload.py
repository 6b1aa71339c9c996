"""Microbatch assignment: quotas by weight, redistribution of a lost replica's microbatches, loss weights.

Owns: the mapping microbatch index -> owning replica for one step, as a tuple `owners` of length M
(`owners[i]` is the replica id computing microbatch `(s, i)`), and how it changes when replicas leave.
Does not own: which replicas are alive (membership), measuring speeds (detection), or any tensor.

Every function is deterministic in its arguments, so every member that sees the same membership history
derives the same owners without talking to the others.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import eq

PARKED = 0.0  # a quota weight that parks its member: it owns no microbatch of the step (see `assign`)


def quotas(total: int, members: Sequence[int], weights: Mapping[int, float] | None = None) -> dict[int, int]:
    """Split `total` items among `members` in proportion to `weights` (largest-remainder rounding).

    Missing or negative weights count as the mean weight of the others (1.0 if none is given), so an
    unmeasured replica gets an equal share. A weight of exactly 0 parks the member (`PARKED`: no items)
    while any member has a positive or unmeasured share; if every member is parked, all share equally
    (the work must be done by someone). Ties in the remainders go to the lower replica id.
    Raises ValueError when `members` is empty and `total` > 0.
    """
    members = sorted(members)
    if not members:
        if total:
            raise ValueError("no members to take the work")
        return {}
    parked = _parked(members, weights)
    given = [weights[m] for m in members if weights and weights.get(m, 0) > 0]
    fallback = sum(given) / len(given) if given else 1.0
    w = {m: (0.0 if m in parked else weights[m] if weights and weights.get(m, 0) > 0 else fallback)
         for m in members}
    wsum = sum(w.values())
    exact = {m: total * w[m] / wsum for m in members}
    q = {m: int(exact[m]) for m in members}
    left = total - sum(q.values())
    by_remainder = sorted(members, key=lambda m: (-(exact[m] - q[m]), m))
    for m in by_remainder[:left]:
        q[m] += 1
    return q


def _parked(members: Sequence[int], weights: Mapping[int, float] | None) -> set[int]:
    """The members weighted PARKED, or none if that is every member (someone must do the work)."""
    parked = {m for m in members if weights and weights.get(m) == PARKED}
    return set() if len(parked) == len(set(members)) else parked


def assign(num_microbatches: int, members: Sequence[int], weights: Mapping[int, float] | None = None) -> tuple[int, ...]:
    """Owners at the start of a step: contiguous blocks of microbatches, in replica-id order.

    Call once per step with the step's plan (members and quota weights). Returns `owners`, length M.
    When there are at least as many microbatches as members, every member that is not parked (weight
    `PARKED`) keeps at least one, so a replica judged slow is still measured and can be seen to recover
    (taken from the largest quota). A parked member owns none: ResiHP's "drop" of a slow group, which
    stays in the epoch reducing a zero share (its state stays in step) but is no longer measured.
    """
    q = quotas(num_microbatches, members, weights)
    parked = _parked(members, weights)
    active = [m for m in sorted(q) if m not in parked]
    if num_microbatches >= len(active):
        for m in active:
            if q[m] == 0:
                donor = max(sorted(q), key=lambda d: q[d])
                q[donor] -= 1
                q[m] = 1
    owners: list[int] = []
    for m in sorted(members):
        owners.extend([m] * q[m])
    return tuple(owners)


def makespan(owners: Sequence[int], speeds: Mapping[int, float]) -> float:
    """Predicted step time of `owners`, in healthy-microbatch units: the busiest replica's count over its
    speed (a replica missing from `speeds` counts as 1.0). Equal-cost microbatches assumed."""
    counts: dict[int, int] = {}
    for o in owners:
        counts[o] = counts.get(o, 0) + 1
    return max((n / max(speeds.get(r, 1.0), 1e-9) for r, n in counts.items()), default=0.0)


def worth_replanning(total: int, members: Sequence[int], current: Mapping[int, float],
                     proposed: Mapping[int, float], min_gain: float = 0.05) -> bool:
    """Whether quotas from `proposed` speeds beat the quotas in force (from `current`) by more than
    `min_gain` of predicted step time, both judged under `proposed`, the newer estimate.

    Call when the detector's speeds change, before publishing them as weights. Why: speed estimates
    jitter by a few percent from step to step, and near a rounding boundary each jitter would move one
    microbatch back and forth (and a changed plan can cost members a redo) for no gain. A replica that
    turns slow or recovers changes the predicted time by far more than `min_gain`.
    """
    if not members:
        return False
    now = makespan(assign(total, members, current), proposed)
    new = makespan(assign(total, members, proposed), proposed)
    return new < (1.0 - min_gain) * now


def redistribute(owners: Sequence[int], members: Sequence[int], weights: Mapping[int, float] | None = None) -> tuple[int, ...]:
    """Give the microbatches of replicas no longer in `members` to the survivors, by quota weight.

    Microbatches of surviving replicas keep their owner (their work is already in that survivor's local
    accumulator); the orphaned ones, in index order, are split in contiguous runs among the survivors.
    Raises ValueError when `members` is empty and anything is orphaned.
    """
    alive = set(members)
    orphans = [i for i, o in enumerate(owners) if o not in alive]
    if not orphans:
        return tuple(owners)
    q = quotas(len(orphans), sorted(alive), weights)
    new = list(owners)
    it = iter(orphans)
    for m in sorted(alive):
        for _ in range(q[m]):
            new[next(it)] = m
    return tuple(new)


def replay(owners: Sequence[int], history: Sequence[Sequence[int]], weights: Mapping[int, float] | None = None) -> tuple[int, ...]:
    """Owners after a sequence of membership epochs (each a member list), applied in order.

    A member that skipped an intermediate epoch derives the same owners as one that lived through it,
    because the result depends only on the recorded history.
    """
    for members in history:
        owners = redistribute(owners, members, weights)
    return tuple(owners)


def mine(owners: Sequence[int], replica: int) -> frozenset[int]:
    """The microbatch indices owned by `replica`."""
    return frozenset(compress(range(len(owners)), map(eq, owners, repeat(replica))))


def loss_weight(microbatch_tokens: int, step_tokens: int) -> float:
    """Weight of one microbatch's mean loss in the step's loss: its share of the step's tokens.

    With these weights the step gradient is sum_i w_i * grad(mean loss_i), whatever the assignment.
    Raises ValueError for a step with no tokens.
    """
    if step_tokens <= 0:
        raise ValueError("a step needs at least one token")
    return microbatch_tokens / step_tokens
