"""Silent corruption: which replicas' digests disagree, who is wrong, who heals them, when a device goes.

Pure (no torch, no I/O, no clock). Every member of a step computes the same answer from the same
digests, so the verdict needs no decision of its own in the store: the digests are the agreement.

Owns: the majority vote over digests that must be equal (`vote`), the steps a state check runs at
(`state_check_due`), and the count of times each device was found wrong with the eviction threshold
(`Suspects`). Does not own: computing digests, publishing or reading them, or healing (runtime/trainer/
agreement.py); evicting (the coordinator's re-planning path).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing digests that must agree.

    agreed: the majority's digest (None: no strict majority, so nobody can say who is wrong);
    wrong: the members whose digest differs from it, ascending; donor: the lowest member holding the
    majority's digest (the one that heals the wrong ones; None without a majority)."""
    agreed: str | None
    wrong: tuple[int, ...]
    donor: int | None

    @property
    def split(self) -> bool:
        """Digests differ and no strict majority says which is right (two replicas, or a three-way split)."""
        return self.agreed is None


def vote(digests: dict[int, str]) -> Verdict:
    """Compare each member's digest (`digests`: member -> digest, of state or of a gradient that every
    member must hold bit for bit). A digest held by more than half of the members is the truth; every
    member holding another is wrong. Without a strict majority the verdict is split: with two members
    (or a tie) a mismatch is seen but nobody is outvoted. An empty or unanimous input is never wrong."""
    if not digests:
        return Verdict(None, (), None)
    counts = Counter(digests.values())
    top, n = counts.most_common(1)[0]
    if 2 * n <= len(digests):
        return Verdict(None, (), None) if len(counts) > 1 else Verdict(top, (), min(digests))
    holders = sorted(m for m, d in digests.items() if d == top)
    return Verdict(top, tuple(sorted(m for m, d in digests.items() if d != top)), holders[0])


def state_check_due(step: int, every: int) -> bool:
    """Whether the state of replicas is compared after committing `step` (steps count from 0): after
    every `every`-th step (steps every-1, 2*every-1, ...); `every` <= 0: never. A corruption of state
    that lands after step s's check is found at the next one, at most `every` steps later."""
    return every > 0 and (step + 1) % every == 0


@dataclass(frozen=True)
class Suspects:
    """How many times each device (a name: "group g rank j") was found wrong, and which were evicted.
    A value: `found` returns the next one."""
    counts: dict[str, int] = field(default_factory=dict)
    evicted: tuple[str, ...] = ()

    def found(self, device: str, evict_after: int) -> tuple[Suspects, bool]:
        """`device` found wrong once more; (the new value, whether it is to be evicted now: the
        `evict_after`-th time it was found wrong, once; `evict_after` <= 0: never)."""
        counts = {**self.counts, device: self.counts.get(device, 0) + 1}
        evict = 0 < evict_after <= counts[device] and device not in self.evicted
        return Suspects(counts, self.evicted + ((device,) if evict else ())), evict


def _unit(seed: int, step: int, i: int) -> float:
    """A uniform draw in [0, 1), a pure function of (seed, step, i): splitmix64 of their mix."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + i * 0x94D049BB133111EB + 1) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) / 2**64


def recomputed(step: int, num_microbatches: int, fraction: float, seed: int = 0) -> tuple[int, ...]:
    """The microbatches of `step` whose gradient is computed again on other replicas and compared:
    each one independently with probability `fraction` (a pure function of (seed, step, i), so every
    member draws the same set). 0: none; 1: all."""
    if fraction <= 0:
        return ()
    return tuple(i for i in range(num_microbatches) if _unit(seed, step, i) < fraction)


def checkers(owner: int, members: tuple[int, ...], i: int, n: int = 2) -> tuple[int, ...]:
    """The `n` members (fewer where fewer are left) that recompute microbatch `i` owned by `owner`: the
    other members in ascending order, rotated by `i` so the extra work spreads over the fleet."""
    others = sorted(m for m in members if m != owner)
    if not others:
        return ()
    k = i % len(others)
    return tuple((others[k:] + others[:k])[:n])
