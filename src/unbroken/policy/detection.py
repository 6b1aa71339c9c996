"""Fail-slow detection: which replicas run slower than their own workload explains, and how much slower.

Owns: the per-replica score (observed / predicted time, from the fleet-wide `Predictor`), common-mode
rejection (a shift every replica shares is a regime change, not a straggler), a CUSUM sequential test with
hysteresis giving Healthy / Suspect / Slow verdicts, speed estimates usable as quota weights, and which
samples may teach the predictor (only those of Healthy replicas).
Does not own: fail-stop (the coordinator's heartbeats do), measuring time, or moving microbatches: the
caller passes `speeds()` to `unbroken.policy.workload.quotas(total, members, weights)`.

Scores are in log units: x = log(observed / predicted), so 0 is "as predicted" and log(1.3) = 0.26 is 30%
slow. Each step a replica's score is the median of its microbatches' log ratios (one outlier microbatch
does not count), minus the fleet median (common-mode shifts cancel; fleets under `min_fleet` replicas
subtract only the move all of them share). A move of most replicas beyond `regime_move` is a regime change
(a new model size): the predictor is rescaled and restarts its window instead of anyone being flagged. The CUSUM S <- clamp(S + x - drift)
adds evidence step by step; a single step adds at most `max_increment`, so one bad step never condemns.

The thresholds adapt to the noise each replica's score shows (policy/noise.py): a robust estimate of it
over the replica's recent Healthy steps (erring high while young), floored at the fleet's, sets drift, suspect_at, slow_at,
max_increment and recover_below to the larger of their fixed values (set for a noise of ~0.05) and a
multiple of the noise, so a noisy host raises the bar instead of the alarm rate. Latency of a sustained
slowdown by f at noise s: n = ceil(slow_at(s) / min(log f - drift(s), max_inc(s))) steps; with the
defaults, at s <= 0.064 1.3x in 3 steps, at s = 0.15 1.3x in 10 and 2x in 2 (table: policy/noise.py;
`Detector.thresholds(r).latency(f)` computes it). `noise()` reports what each replica's thresholds took.
Pure and O(replicas + samples) per step.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.policy.noise import NoiseConfig, NoiseTracker, Thresholds, effective, fleet_noise, thresholds
from unbroken.policy.predictor import CostModel, MicrobatchTiming, Predictor, SameWork, median


class Verdict(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # evidence building up; work is not moved yet
    SLOW = "slow"  # confirmed: speeds() gives it less work until it recovers


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Thresholds of the sequential test, in log units of observed/predicted time. drift, suspect_at,
    slow_at, max_increment and recover_below are the floors of the adaptive thresholds (`noise`)."""
    # CUSUM allowance: slowdowns under ~8% are tolerated, never accumulate. A healthy replica's step score
    # can sit at +0.15..+0.2 for several steps in a row (cache and memory contention from its neighbours
    # shows even in CPU time); an allowance of 8% keeps such a stretch from reaching Slow while 1.26x and
    # more are still declared within 3 steps (the figures: benchmarks/RESULTS.md, detect-eval).
    drift: float = math.log(1.08)
    suspect_at: float = 0.15  # CUSUM level for Suspect (one 1.2x step reaches it)
    slow_at: float = 0.45  # CUSUM level for Slow: 1.3x sustained gets there in 3 steps, 1.6x+ in 2
    max_increment: float = 0.3  # evidence one step may add: one bad step alone is at most Suspect
    recover_below: float = math.log(1.08)  # a Slow replica's step counts as calm under this score ...
    recover_steps: int = 3  # ... and this many calm steps in a row make it Healthy again
    regime_move: float = math.log(1.15)  # a replica "moved" when its raw score is beyond +-15% ...
    regime_quorum: float = 0.5  # ... and more than this share moving the same way is a regime change
    min_fleet: int = 3  # replicas of a class needed to normalize by the fleet median (else: shared move)
    speed_window: int = 8  # recent steps whose median gives a Slow replica's speed estimate (a
    # burst of host noise over a few steps must not halve it: its quotas would follow)
    min_speed: float = 0.1  # lowest speed reported, so a slow replica keeps some work and can show recovery
    # A run's first steps: the detector's first `warmup_steps` observed steps add evidence above
    # `warmup_drift` only (a 1.3x allowance, not 1.08x). Start-up inflates healthy replicas' device time
    # for a step or two (1.6-2x their peers' on a shared host, enough to reach Slow with the run's
    # allowance). A slowdown present from the first step is still found as soon: 2x adds 0.43 a step
    # (capped at max_increment), Slow in 2 steps; under 1.3x it is found once the warm-up is over.
    warmup_steps: int = 6
    warmup_drift: float = math.log(1.3)
    # A member that joins a running fleet (restarted, replaced or re-formed: its track is new after the
    # run's first step) warms up as the fleet did: its first `join_skip` steps are neither scored nor
    # taught to the predictor, and its first `warmup_steps` add evidence above `warmup_drift` only.
    # A group grown back under torchrun runs its first step 6-8x slow (first kernels, allocator, the new
    # epoch's groups) and its next two 1.1-1.5x: judged like the others, it would be declared Slow and
    # lose its quota for good.
    join_skip: int = 1
    noise: NoiseConfig = NoiseConfig()  # how the thresholds follow each replica's measured noise

    def base(self) -> Thresholds:
        """The fixed thresholds: those in force at or below the design noise."""
        return Thresholds(self.noise.design_noise, self.drift, self.suspect_at, self.slow_at,
                          self.max_increment, self.recover_below)


@dataclass(frozen=True, slots=True)
class VerdictChange:
    """A replica's verdict changed at `step`; `speed` is its estimate after the change (1.0 unless Slow)."""
    step: int
    replica: int
    old: Verdict
    new: Verdict
    speed: float
    score: float  # this step's normalized log(observed/predicted)
    noise: float = 0.0  # the replica's noise its thresholds took at this step (Detector.noise)


@dataclass(frozen=True, slots=True)
class RegimeChange:
    """Most replicas of `device_class` moved together at `step` by `factor`: the predictor was rescaled."""
    step: int
    device_class: str
    factor: float
    moved: int  # replicas beyond `regime_move`
    replicas: int


@dataclass(slots=True)
class _Track:
    device_class: str
    verdict: Verdict = Verdict.HEALTHY
    cusum: float = 0.0
    calm: int = 0
    # steps since the CUSUM last reached suspect_at from below (and while Slow): how far back the current
    # episode goes. Not "since the CUSUM was last 0": timing noise keeps a healthy replica's CUSUM a
    # little above 0 for steps on end, and those steps would dilute the speed estimate (whole-run
    # simulation: a 2x replica estimated at 0.67)
    run: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # step-sum log ratios
    joined: bool = False  # tracked first after the run's first step: it warms up on its own (join_skip)
    seen: int = 0  # steps observed with microbatches, skipped ones included
    noise: NoiseTracker | None = None  # its scores while Healthy (set by the Detector: needs the config)


class Detector:
    """Fleet-wide fail-slow detector.

    Calling contract: once per committed step, `observe(step, timings)` with every replica's microbatch
    timings of that step (a replica with no microbatches this step may be left out; it keeps its state).
    Then `take_events()` for the verdict and regime changes to log, and `speeds()` for the next quotas.
    `forget(replica)` when the coordinator declares a replica dead: when it is back (a restart, a
    replacement, a re-formed group), its first steps are taken as its warm-up (`join_skip`).
    """

    def __init__(self, config: DetectorConfig | None = None, predictor: Predictor | None = None,
                 device_classes: Mapping[int, str] | None = None):
        self.config = config or DetectorConfig()
        self.predictor = predictor or Predictor()
        self._classes = dict(device_classes or {})
        self._tracks: dict[int, _Track] = {}
        self._events: list[VerdictChange | RegimeChange] = []
        self._observed = 0  # steps observed so far (the warm-up counts them)
        self._fleet: dict[str, float | None] = {}  # device class -> its fleet noise, re-estimated ...
        self._fleet_age: dict[str, int] = {}  # ... every `noise.every` scored steps
        self._base = self.config.base()
        self._levels: dict[float, Thresholds] = {}  # noise -> thresholds at it (pure: a cache)

    def observe(self, step: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> dict[int, Verdict]:
        """Score one step and update verdicts. Returns the verdict of every replica tracked."""
        self._observed += 1
        by_class: dict[str, dict[int, Sequence[MicrobatchTiming]]] = {}
        for r, mbs in timings.items():
            if mbs:
                by_class.setdefault(self._classes.get(r, "default"), {})[r] = mbs
        for cls, group in sorted(by_class.items()):
            for r in group:
                t = self._tracks.get(r) or self._tracks.setdefault(
                    r, _Track(cls, joined=self._observed > 1, noise=NoiseTracker(self.config.noise)))
                t.seen += 1
            # a joiner's first steps are its start-up, not its speed: out of the scores and the predictor
            group = {r: mbs for r, mbs in group.items()
                     if not (self._tracks[r].joined and self._tracks[r].seen <= self.config.join_skip)}
            if not group:
                continue
            if self.predictor.ready(cls):
                self._score(step, cls, group)
            # Only replicas believed healthy teach the predictor: slowness must not become the norm.
            self.predictor.observe(_Concat([mbs for r, mbs in sorted(group.items())
                                            if self._tracks[r].verdict is Verdict.HEALTHY]), cls)
        return {r: t.verdict for r, t in sorted(self._tracks.items())}

    def _score(self, step: int, cls: str, group: Mapping[int, Sequence[MicrobatchTiming]]) -> None:
        cfg, model = self.config, self.predictor.model(cls)
        med: dict[int, float] = {}  # median microbatch log ratio: robust to one outlier microbatch
        tot: dict[int, float] = {}  # log(step time / predicted step time): what quotas care about
        for r, mbs in group.items():
            med[r], tot[r] = _log_ratios(model, mbs)
        n = len(med)
        up = sum(1 for x in med.values() if x > cfg.regime_move)
        down = sum(1 for x in med.values() if x < -cfg.regime_move)
        if max(up, down) > cfg.regime_quorum * n:
            shift = median(list(med.values()))
            self.predictor.rescale(math.exp(shift), cls)
            self._events.append(RegimeChange(step, cls, math.exp(shift), max(up, down), n))
        else:
            shift = 0.0
        # Common mode: what the whole fleet shares is nobody's fault. A fleet of min_fleet or more has a
        # robust centre, its median; a smaller one has none, and takes its fastest replica as the
        # reference instead: fail-slow goes one way only, and the predictor may be biased to the middle
        # of a pair (a replica slow from the first step taught it, too, before it was suspected: a 2x
        # replica beside one healthy one then scored +0.35 instead of +0.69, and its speed read 0.84).
        # A lone replica is therefore never flagged: with nothing to compare it to, a slower device and
        # a heavier model look alike.
        rest = [x - shift for x in med.values()]
        shift += median(rest) if n >= cfg.min_fleet else min(rest)
        for r in sorted(group):
            self._update(step, r, med[r] - shift, tot[r] - shift)
        age = self._fleet_age.get(cls, 0) + 1
        if self._fleet.get(cls) is None or age >= self.config.noise.every:
            self._fleet[cls] = fleet_noise([t.noise for t in self._tracks.values() if t.device_class == cls],
                                           self.config.noise.fleet_min_samples)
            age = 0
        self._fleet_age[cls] = age

    def _update(self, step: int, replica: int, x: float, total: float) -> None:
        cfg, t = self.config, self._tracks[replica]
        t.recent.append(total)
        # the run's first steps, and a joiner's own first ones
        warm = self._observed <= cfg.warmup_steps or (t.joined and t.seen <= cfg.warmup_steps)
        th = self.thresholds(replica)  # at the noise measured before this step
        drift = max(cfg.warmup_drift, th.drift) if warm else th.drift
        t.cusum = min(max(0.0, t.cusum + min(x - drift, th.max_increment)), 2 * th.slow_at)
        t.run = t.run + 1 if t.cusum >= th.suspect_at or t.verdict is Verdict.SLOW else 0
        old = t.verdict
        if old is Verdict.HEALTHY:
            t.noise.add(x)  # its noise is measured on Healthy steps only: a slowdown is not noise
        if old is Verdict.SLOW:
            t.calm = t.calm + 1 if x < th.recover_below else 0
            if t.calm >= cfg.recover_steps:
                # the episode is over: a later one must not average in its steps (run counts anew)
                t.verdict, t.cusum, t.calm, t.run = Verdict.HEALTHY, 0.0, 0, 0
        elif t.cusum >= th.slow_at:
            t.verdict, t.calm = Verdict.SLOW, 0
            t.noise.slow()
        elif t.cusum >= th.suspect_at:
            t.verdict = Verdict.SUSPECT
        elif old is Verdict.SUSPECT and t.cusum == 0.0:
            t.verdict = Verdict.HEALTHY
        if t.verdict is not old:
            self._events.append(VerdictChange(step, replica, old, t.verdict, self._speed(t), x, th.noise))

    def _speed(self, t: _Track) -> float:
        if t.verdict is not Verdict.SLOW:
            return 1.0
        # Only steps of the current episode: a 3x slowdown confirmed after 2 steps must not be averaged
        # with the healthy steps before its onset.
        recent = list(t.recent)[-max(1, min(self.config.speed_window, t.run)):]
        return min(1.0, max(self.config.min_speed, math.exp(-median(recent))))

    def speeds(self) -> dict[int, float]:
        """Relative speed of every tracked replica (1.0 = as predicted, 0.5 = half speed): quota weights.
        Only Slow replicas get an estimate below 1, so noise never moves work."""
        return {r: self._speed(t) for r, t in sorted(self._tracks.items())}

    def noise(self) -> dict[int, float]:
        """Every tracked replica's noise (a standard deviation of its step score, log units) as its
        thresholds take it now: its own robust estimate over its recent Healthy steps, floored at its
        fleet's (`fleet_noise`) and capped at `noise.cap` x it; the design noise before any is measured
        (policy/noise.py: `effective`). Any time."""
        return {r: self._noise_of(t) for r, t in sorted(self._tracks.items())}

    def fleet_noise(self) -> dict[str, float]:
        """Each device class's noise (its replicas' recent Healthy scores pooled, raised by three standard
        errors), for the classes that have `noise.fleet_min_samples` of them ("default" without device
        classes). Any time."""
        return {c: v for c, v in sorted(self._fleet.items()) if v is not None}

    def thresholds(self, replica: int) -> Thresholds:
        """The thresholds `replica` is judged by now (the fixed ones for an unknown replica);
        `.latency(factor)` is the steps a sustained slowdown by `factor` takes to reach Slow."""
        t = self._tracks.get(replica)
        noise = self._noise_of(t) if t is not None else self.config.noise.design_noise
        levels = self._levels.get(noise)
        if levels is None:
            if len(self._levels) >= 4096:  # estimates drift: keep the cache small
                self._levels.clear()
            levels = self._levels[noise] = thresholds(noise, self._base, self.config.noise)
        return levels

    def _noise_of(self, t: _Track) -> float:
        return effective(t.noise.own(), self._fleet.get(t.device_class), self.config.noise)

    def verdicts(self) -> dict[int, Verdict]:
        return {r: t.verdict for r, t in sorted(self._tracks.items())}

    def take_events(self) -> list[VerdictChange | RegimeChange]:
        """Verdict and regime changes since the last call, oldest first (the caller logs them)."""
        out, self._events = self._events, []
        return out

    def forget(self, replica: int) -> None:
        """Drop a replica's state (declared dead, or replaced by a fresh one). Unknown replicas are ignored."""
        self._tracks.pop(replica, None)


def _log_ratios(model: CostModel, mbs: Sequence[MicrobatchTiming]) -> tuple[float, float]:
    """(median over the microbatches of log(observed / predicted), log(step seconds / predicted step
    seconds)) of one replica-step. Microbatches of the same work (`SameWork`) share one prediction."""
    if isinstance(mbs, SameWork):
        p, secs = model.predict(mbs.tokens, mbs.sumsq), mbs.seconds
        preds = [p] * len(secs)
        return median([math.log(x / p) for x in secs]), math.log(sum(secs) / sum(preds))
    preds = [model.predict(m.tokens, m.sumsq) for m in mbs]
    return (median([math.log(m.seconds / p) for m, p in zip(mbs, preds)]),
            math.log(sum(m.seconds for m in mbs) / sum(preds)))


class _Concat(Sequence[MicrobatchTiming]):
    """Several replicas' timings end to end, as one sequence, without copying them: the predictor keeps
    only the last `window` of a step's samples, and slices only those."""

    def __init__(self, parts: list[Sequence[MicrobatchTiming]]):
        self._parts = parts
        self._len = sum(map(len, parts))

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[MicrobatchTiming]:
        for part in self._parts:
            yield from part

    def __getitem__(self, i):  # type: ignore[override]
        if not isinstance(i, slice):
            return list(self)[i]
        start, stop, stride = i.indices(self._len)
        if stride != 1:
            return list(self)[i]
        out: list[MicrobatchTiming] = []
        at = 0  # index of the first item of `part`
        for part in self._parts:
            n = len(part)
            if at + n > start and at < stop:
                out.extend(part[max(0, start - at):min(n, stop - at)])
            at += n
        return out
