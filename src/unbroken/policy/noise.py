"""The fail-slow detector's noise model: how noisy each replica's step score is, and the thresholds and
detection latency that follow from it.

Owns: a robust estimate of the residual noise of each replica's normalized step score x (the standard
deviation of its recent scores taken while Healthy, counted once `lag` later steps passed without it
reaching Slow (a slowdown's first steps are not its noise), winsorized at 3 robust sds, so that a few
outlying steps move it little), the fleet's noise (the same over its replicas' scores pooled, raised by
three standard errors of the estimate, so that a young one errs high), each replica's effective noise
(its own, floored at the fleet's and capped at `cap` x the fleet's), the CUSUM thresholds at a given
noise, and the latency they give. Does not own: the scores or the CUSUM (detection.py).

Thresholds at noise s (log units; each fixed value is a floor, set for the design noise of ~0.05):
    drift(s)      = max(drift, drift_sigmas * s)          allowance subtracted from every step's score
    suspect_at(s) = max(suspect_at, suspect_sigmas * s)
    slow_at(s)    = max(slow_at, slow_sigmas * s)
    max_inc(s)    = max_increment * slow_at(s) / slow_at  one step adds at most this (never Slow alone)
    recover(s)    = max(recover_below, recover_sigmas * s)
With the defaults (1, 2, 7 and 1 standard deviations) the fixed values hold up to s = 0.064 (drift to
0.077): at the design noise the detector behaves as with fixed thresholds. Above, the allowance and the
Slow level grow with the noise, so a noisy host raises the bar instead of the alarm rate: for scores with
independent Gaussian noise, a CUSUM with allowance 1 s and level 7 s crosses it about once in 10^6
healthy steps (Siegmund's approximation), where the fixed thresholds at s = 0.15 (0.51 s and 3 s) cross it
about once in 125.

Latency: a sustained slowdown by factor f adds d = min(log f - drift(s), max_inc(s)) a step, so it is
declared Slow on its n-th step, n = ceil(slow_at(s) / d), and never when log f <= drift(s). Noise spreads
n: `latency(f, s, z)` is the first n with n d - z s sqrt(n) >= slow_at(s), by which a Gaussian-noise
CUSUM has reached Slow in all but a tail of z standard deviations. At s <= 0.064: 1.3x in 3 steps, 1.6x
and more in 2. At s = 0.10: drift 0.10, Slow 0.70, 1.3x in 5 steps, 1.5x in 3, 2x in 2. At s = 0.15:
drift 0.15, Slow 1.05, 1.3x in 10 steps, 1.5x in 5, 2x in 2. At s = 0.20: drift 0.20, Slow 1.40, 1.3x
in 23 steps, 1.5x in 7, 2x in 3; 1.2x (log 0.18) is below the allowance: never.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import chain, repeat
from operator import sub
from dataclasses import dataclass


WINSOR = 3.0  # scores beyond this many robust sds from the median count as if at that distance
Q75_TO_SD = 1.15  # a Gaussian's 75th percentile of absolute deviations, in sds
MARGIN_SE = 3.0  # standard errors an estimate is raised by (see `upper`)


@dataclass(frozen=True, slots=True)
class NoiseConfig:
    """How the thresholds follow the measured noise (see the module docstring for the rule)."""
    design_noise: float = 0.05  # the noise the fixed thresholds are set for (reported when none is measured)
    window: int = 64  # a replica's recent Healthy scores its estimate is taken over
    min_samples: int = 16  # scores a replica needs before its own estimate counts ...
    fleet_min_samples: int = 12  # ... and a fleet (all its replicas' together) before its estimate does
    lag: int = 4  # a score counts once this many later steps passed without the replica reaching Slow:
    # a slowdown's first steps (Healthy until the CUSUM has its evidence) are not its noise: counted at
    # once, an episode's own slow steps would raise its replica's noise until the episode could never
    # be declared.
    every: int = 4  # new scores between re-estimates (a sort of `window` values each)
    cap: float = 2.0  # a replica's noise counts at most this x the fleet's: a replica whose slowness
    # builds up while still Healthy must not raise its own bar out of reach
    drift_sigmas: float = 1.0
    suspect_sigmas: float = 2.0
    slow_sigmas: float = 7.0
    recover_sigmas: float = 1.0


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The CUSUM's levels at one noise (log units of observed / predicted time)."""
    noise: float
    drift: float
    suspect_at: float
    slow_at: float
    max_increment: float
    recover_below: float

    def latency(self, factor: float, z: float = 0.0) -> float:
        """Steps a sustained slowdown by `factor` takes to reach Slow (its onset step is the 1st):
        the first n with n * d - z * noise * sqrt(n) >= slow_at, d = min(log factor - drift, max_increment).
        z = 0: the noiseless latency; z = 3: by then in all but ~0.1% of episodes (Gaussian noise).
        math.inf when the factor is within the allowance."""
        d = min(math.log(factor) - self.drift, self.max_increment)
        if d <= 0:
            return math.inf
        n = 1
        while n * d - z * self.noise * math.sqrt(n) < self.slow_at:
            n += 1
        return n


def thresholds(noise: float, base: Thresholds, cfg: NoiseConfig) -> Thresholds:
    """The levels at `noise` (a standard deviation of the step score): each the larger of its fixed
    value in `base` and its multiple of `noise`."""
    slow = max(base.slow_at, cfg.slow_sigmas * noise)
    return Thresholds(noise, max(base.drift, cfg.drift_sigmas * noise), max(base.suspect_at, cfg.suspect_sigmas * noise),
                      slow, base.max_increment * slow / base.slow_at,
                      max(base.recover_below, cfg.recover_sigmas * noise))


class NoiseTracker:
    """Per-replica robust noise of the step score. Calling contract: `add(x)` once a step with the
    replica's score while it is Healthy; `slow()` when it is declared Slow (its scores of the last `lag`
    steps were the slowdown's, not noise: dropped); `own()` any time (None until `min_samples`)."""

    __slots__ = ("cfg", "scores", "pending", "fresh", "estimate")

    def __init__(self, cfg: NoiseConfig):
        self.cfg = cfg
        self.scores: deque[float] = deque(maxlen=cfg.window)  # counted: `lag` steps old or more
        self.pending: deque[float] = deque()  # the last `lag` Healthy steps' scores
        self.fresh = 0  # scores counted since the last re-estimate
        self.estimate: float | None = None

    def add(self, x: float) -> None:
        self.pending.append(x)
        if len(self.pending) <= self.cfg.lag:
            return
        self.scores.append(self.pending.popleft())
        self.fresh += 1
        if len(self.scores) >= self.cfg.min_samples and (self.estimate is None or self.fresh >= self.cfg.every):
            self.estimate = robust_sd(list(self.scores))  # its point estimate: see `effective`
            self.fresh = 0

    def slow(self) -> None:
        self.pending.clear()

    def own(self) -> float | None:
        return self.estimate


def fleet_noise(trackers: list[NoiseTracker], min_samples: int) -> float | None:
    """The fleet's noise: the robust spread of its replicas' Healthy scores pooled, so a fleet has an
    estimate 3 steps into a run (4 replicas), before any replica has `min_samples` of its own; None under
    `min_samples` scores in all. The last `lag` steps' count too: one replica's slowdown is a share of the
    pool, and without them the first steps after the run's warm-up were judged by the fixed thresholds
    (trace replay at noise 0.15: a healthy replica Slow at step 6). Pooled about their common median,
    not each replica's own: 3 scores a replica centred on their own median read 0.06 at noise 0.15."""
    xs = list(chain.from_iterable(chain(t.scores, t.pending) for t in trackers))
    return upper(robust_sd(xs), len(xs)) if len(xs) >= min_samples else None


def upper(sd: float, n: int) -> float:
    """`sd` estimated from `n` scores, raised by MARGIN_SE of its standard errors (relative error
    ~1/sqrt(2n)): a young estimate (12 scores: x1.61; a window of 64: x1.27; 4 replicas' 256: x1.13)
    must not set the bar low by chance. In trace replay at noise 0.15, point estimates of 0.09 after 8
    steps (against 0.13 later) let a healthy replica reach Slow."""
    return sd * (1.0 + MARGIN_SE * math.sqrt(0.5 / n))


def robust_sd(xs: list[float]) -> float:
    """The standard deviation of `xs` winsorized at WINSOR robust sds from their median, the robust sd
    being the 75th percentile of the absolute deviations over a Gaussian's (1.15 sd): up to a quarter of
    outlying scores (a hiccup of a step, the first steps of replicas that are slow from the start) are
    clipped. Not a MAD-based sd: scores normalized by a small fleet's median crowd near 0 (two of 4
    replicas sit beside it every step; a fleet of 2 is normalized by its faster replica, at 0 exactly,
    half the scores), their MAD read 0.80x their sd in trace replay, and the CUSUM's false alarms come
    from the tail."""
    srt = sorted(xs)
    n = len(srt)
    mid = srt[n // 2] if n % 2 else (srt[n // 2 - 1] + srt[n // 2]) / 2
    scale = _kth_deviation(srt, mid, min(n - 1, (3 * n) // 4)) / Q75_TO_SD
    lo, hi = (mid - WINSOR * scale, mid + WINSOR * scale) if scale > 0 else (-math.inf, math.inf)
    # clipping a sorted list: a prefix below lo becomes lo, a suffix above hi becomes hi. fsum is exactly
    # rounded, so the order the values are summed in does not change a bit of the result.
    below, kept = bisect_left(srt, lo), bisect_right(srt, hi)
    inner = srt[below:kept]
    mean = math.fsum((*repeat(lo, below), *inner, *repeat(hi, n - kept))) / n
    sq = math.fsum((*repeat((lo - mean) ** 2, below), *map(pow, map(sub, inner, repeat(mean)), repeat(2)),
                    *repeat((hi - mean) ** 2, n - kept)))
    return math.sqrt(sq / n)


def _kth_deviation(srt: list[float], mid: float, k: int) -> float:
    """The k-th smallest (from 0) of abs(v - mid) over sorted `srt`, without sorting the deviations: those
    of the values below mid (mid - v, rising as v falls: exactly abs(v - mid), rounding being symmetric)
    and those of the rest (v - mid, rising with v) are two sorted runs; a binary search finds how many of
    the k + 1 smallest come from each. O(log n)."""
    m = bisect_left(srt, mid)

    def below(i: int) -> float:  # i-th smallest deviation among values below mid
        return mid - srt[m - 1 - i]

    def above(j: int) -> float:  # j-th smallest among the others
        return srt[m + j] - mid

    lo, hi = max(0, k + 1 - (len(srt) - m)), min(k + 1, m)
    while lo < hi:  # the smallest i (taken from below) with below(i) >= above(k - i)
        i = (lo + hi) // 2
        if below(i) < above(k - i):
            lo = i + 1
        else:
            hi = i
    i, j = lo, k + 1 - lo
    return max(below(i - 1) if i > 0 else -math.inf, above(j - 1) if j > 0 else -math.inf)


def effective(own: float | None, fleet: float | None, cfg: NoiseConfig) -> float:
    """A replica's noise as its thresholds take it: its own, floored at the fleet's and capped at `cap` x
    the fleet's; the fleet's while it has no estimate of its own; the design noise before any estimate.
    The fleet's errs high (`upper`), the replica's own is its point estimate: raised by its larger
    margin (x1.53 at its first 16 scores) it would lift a young replica's bar above the fleet's on every
    host, where it is to do so only for a replica noisier than its peers."""
    if fleet is None:
        return cfg.design_noise if own is None else own
    if own is None:
        return fleet
    return min(max(own, fleet), cfg.cap * fleet)
