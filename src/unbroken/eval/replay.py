"""Trace-replay evaluation of fail-slow detection: unbroken's detector against three step-time baselines.

Owns: synthetic traces (variable-length workloads, a ground-truth cost model the predictor does not know
exactly, multiplicative noise, outliers, injected slowdowns, optional model-size changes), the baselines,
and the metrics (precision, recall per slowdown-factor bucket, false alarms per 1,000 steps, detection
latency, predictor error).
Does not own: the detector or the predictor (policy/), timing real runs, or printing (benchmarks/).

Pure Python and deterministic: every random draw comes from `random.Random(seed)`. Replay is open-loop
(equal quotas, so every method sees the very same observations); an alarm is a rising edge of a method's
"slow" flag on a replica.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from unbroken.policy.detection import Detector, Verdict
from unbroken.policy.predictor import MicrobatchTiming, median

# Slowdown-factor buckets for recall. Below 1.1x a slowdown sits within the detector's 5% drift allowance
# plus timing noise: traces draw from there only when asked (TraceConfig.factor), and count it honestly.
BUCKETS: tuple[tuple[float, float], ...] = ((1.0, 1.1), (1.1, 1.2), (1.2, 1.5), (1.5, 2.0), (2.0, 3.0))


@dataclass(frozen=True)
class TraceConfig:
    replicas: int = 8
    steps: int = 1000
    microbatches: int = 32  # per step, split equally: 4 per replica at 8 replicas
    seqs_per_microbatch: int = 8  # documents per microbatch, each its own sequence (unpacked) ...
    packed_rows: int = 0  # ... or, when > 0, documents packed into this many rows of `max_len` tokens
                          # (document-masked attention: each document piece attends only to itself)
    doc_median: float = 400.0  # tokens; document lengths are lognormal (heavy tail) ...
    doc_sigma: float = 1.3  # ... with this log-sd, and ...
    max_len: int = 4096  # ... truncated at the context length
    a: float = 2e-5  # ground truth: s per token
    b: float = 1e-8  # s per token^2: attention equals the linear cost at 2,000-token sequences
    c: float = 5e-3  # s per microbatch
    tile: int = 128  # attention runs on 128-token tiles: a cost the predictor's features do not see
    noise: float = 0.03  # log-sd of per-microbatch timing noise (3%)
    step_noise: float = 0.0  # log-sd of a replica-step component its microbatches share (a host's noise:
    step_noise_lag1: float = 0.2  # 0.05-0.2 on real runs), AR(1) with this lag-1 correlation (as sim/)
    outlier_rate: float = 0.003  # share of microbatches hit by a one-off hiccup ...
    outlier_factor: tuple[float, float] = (1.5, 4.0)  # ... of this size
    device_spread: float = 0.02  # replicas' fixed speeds differ by up to +-2% (no two GPUs are equal)
    slowdowns: int = 6  # injected episodes per trace
    factor: tuple[float, float] = (1.1, 3.0)  # slowdown factors, log-uniform
    duration: tuple[int, int] = (10, 150)  # steps
    warmup: int = 20  # no slowdown starts before this step
    grace: int = 5  # steps after an episode's end during which a flag still counts as true
    regime_factor: float | None = None  # every cost times this from a random step on (a model-size change)


@dataclass(frozen=True)
class Slowdown:
    replica: int
    onset: int  # first slow step
    end: int  # first step at full speed again
    factor: float  # time multiplier, > 1


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    slowdowns: tuple[Slowdown, ...]
    regime_at: int | None
    steps: tuple[dict[int, tuple[MicrobatchTiming, ...]], ...]  # per step: replica -> its microbatches

    def factor(self, replica: int, step: int) -> float:
        return next((s.factor for s in self.slowdowns if s.replica == replica and s.onset <= step < s.end), 1.0)


def _place_slowdowns(cfg: TraceConfig, rng: random.Random) -> list[Slowdown]:
    placed: list[Slowdown] = []
    for _ in range(cfg.slowdowns):
        for _try in range(100):
            dur = rng.randint(*cfg.duration)
            if cfg.steps - dur <= cfg.warmup:
                break
            r, onset = rng.randrange(cfg.replicas), rng.randint(cfg.warmup, cfg.steps - dur)
            # Episodes on one replica keep apart, so each alarm has one episode to be matched to.
            if all(s.replica != r or onset >= s.end + 3 * cfg.grace or onset + dur + 3 * cfg.grace <= s.onset
                   for s in placed):
                lo, hi = (math.log(f) for f in cfg.factor)
                placed.append(Slowdown(r, onset, onset + dur, math.exp(rng.uniform(lo, hi))))
                break
    return sorted(placed, key=lambda s: (s.onset, s.replica))


def _packed(cfg: TraceConfig, mu: float, rng: random.Random) -> list[int]:
    """Lengths of the document pieces filling `packed_rows` rows of `max_len` tokens (a document that
    overflows a row is cut there; its rest is dropped, as a packing data loader would carry it over)."""
    pieces = []
    for _ in range(cfg.packed_rows):
        room = cfg.max_len
        while room:
            n = min(room, 1 + int(rng.lognormvariate(mu, cfg.doc_sigma)))
            pieces.append(n)
            room -= n
    return pieces


def generate(cfg: TraceConfig, seed: int) -> Trace:
    """A trace of `cfg.steps` steps. Deterministic in (cfg, seed)."""
    rng = random.Random(seed)
    slowdowns = _place_slowdowns(cfg, rng)
    regime_at = rng.randint(cfg.steps // 4, 3 * cfg.steps // 4) if cfg.regime_factor else None
    speed = [1.0 + rng.uniform(-cfg.device_spread, cfg.device_spread) for _ in range(cfg.replicas)]
    per = cfg.microbatches // cfg.replicas
    mu = math.log(cfg.doc_median)
    steps = []
    shared = [0.0] * cfg.replicas  # the replica-step noise, last step (stationary log-sd step_noise)
    phi = cfg.step_noise_lag1
    for s in range(cfg.steps):
        scale = cfg.regime_factor if regime_at is not None and s >= regime_at else 1.0
        step: dict[int, tuple[MicrobatchTiming, ...]] = {}
        for r in range(cfg.replicas):
            slow = next((d.factor for d in slowdowns if d.replica == r and d.onset <= s < d.end), 1.0)
            if cfg.step_noise:  # drawn only when asked: traces without it are those of before
                shared[r] = phi * shared[r] + math.sqrt(1.0 - phi * phi) * rng.gauss(0.0, cfg.step_noise)
                slow *= math.exp(shared[r])
            mbs = []
            for _ in range(per):
                lens = _packed(cfg, mu, rng) if cfg.packed_rows else \
                    [min(cfg.max_len, 1 + int(rng.lognormvariate(mu, cfg.doc_sigma)))
                     for _ in range(cfg.seqs_per_microbatch)]
                tokens, sumsq = sum(lens), sum(n * n for n in lens)
                padded = sum(n * cfg.tile * math.ceil(n / cfg.tile) for n in lens)
                t = (cfg.a * tokens + cfg.b * padded + cfg.c) * scale * speed[r] * slow
                t *= rng.lognormvariate(0.0, cfg.noise)
                if rng.random() < cfg.outlier_rate:
                    t *= rng.uniform(*cfg.outlier_factor)
                mbs.append(MicrobatchTiming(tokens, float(sumsq), t))
            step[r] = tuple(mbs)
        steps.append(step)
    return Trace(cfg, tuple(slowdowns), regime_at, tuple(steps))


# --- methods: each maps one step's timings to the set of replicas it calls slow ----------------------------

Method = Callable[[int, Mapping[int, Sequence[MicrobatchTiming]]], set[int]]


def _step_times(timings: Mapping[int, Sequence[MicrobatchTiming]]) -> dict[int, float]:
    return {r: sum(m.seconds for m in mbs) for r, mbs in timings.items()}


def unbroken_method(detector: Detector | None = None) -> Method:
    det = detector or Detector()

    def step(s: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> set[int]:
        return {r for r, v in det.observe(s, timings).items() if v is Verdict.SLOW}
    step.detector = det  # type: ignore[attr-defined]  # the evaluation reads the predictor's error
    return step


def threshold_baseline(factor: float = 1.25, window: int = 20) -> Method:
    """Flag a replica whose step time exceeds `factor` x the running median of the fleet's last `window` steps."""
    hist: deque[list[float]] = deque(maxlen=window)

    def step(s: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> set[int]:
        times = _step_times(timings)
        ref = median([t for h in hist for t in h]) if hist else None
        hist.append(list(times.values()))
        return set() if ref is None else {r for r, t in times.items() if t > factor * ref}
    return step


def zscore_baseline(z: float = 3.0, window: int = 20) -> Method:
    """Flag a replica whose step time is more than `z` standard deviations above the fleet's recent mean."""
    hist: deque[list[float]] = deque(maxlen=window)

    def step(s: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> set[int]:
        times = _step_times(timings)
        flat = [t for h in hist for t in h]
        hist.append(list(times.values()))
        if len(flat) < 2:
            return set()
        mu, sd = statistics.fmean(flat), statistics.pstdev(flat) or 1e-12
        return {r for r, t in times.items() if (t - mu) / sd > z}
    return step


def relative_baseline(threshold: float = 0.75, window: int = 5) -> Method:
    """NVIDIA straggler-detector style: score = best replica's median step time / this replica's median
    over the last `window` steps; flag below `threshold`. Assumes every replica has equal work."""
    hist: dict[int, deque[float]] = {}

    def step(s: int, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> set[int]:
        for r, t in _step_times(timings).items():
            hist.setdefault(r, deque(maxlen=window)).append(t)
        meds = {r: median(list(h)) for r, h in hist.items()}
        best = min(meds.values())
        return {r for r, m in meds.items() if best / m < threshold}
    return step


METHODS: dict[str, Callable[[], Method]] = {
    "unbroken": unbroken_method,
    "threshold 1.25x med": threshold_baseline,
    "z-score > 3": zscore_baseline,
    "NVIDIA rel. < 0.75": relative_baseline,
}


# --- metrics ---------------------------------------------------------------------------------------------

@dataclass
class Tally:
    """Counts summed over traces; `metrics()` turns them into rates."""
    steps: int = 0
    alarms: int = 0
    false_alarms: int = 0
    episodes: dict[tuple[float, float], int] = field(default_factory=lambda: {b: 0 for b in BUCKETS})
    detected: dict[tuple[float, float], int] = field(default_factory=lambda: {b: 0 for b in BUCKETS})
    latencies: list[int] = field(default_factory=list)
    ape: list[float] = field(default_factory=list)  # predictor error on held-out healthy microbatches
    found: list[tuple[float, float]] = field(default_factory=list)  # per episode: factor, latency (nan: missed)

    def metrics(self) -> Metrics:
        eps, det = sum(self.episodes.values()), sum(self.detected.values())
        return Metrics(
            precision=(self.alarms - self.false_alarms) / self.alarms if self.alarms else 1.0,
            recall=det / eps if eps else 1.0,
            recall_by_bucket={b: (self.detected[b] / n if n else math.nan) for b, n in self.episodes.items()},
            false_alarms_per_1000=1000.0 * self.false_alarms / self.steps if self.steps else 0.0,
            latency_median=median(self.latencies) if self.latencies else math.nan,
            latency_mean=statistics.fmean(self.latencies) if self.latencies else math.nan,
            predictor_mdape=median(self.ape) if self.ape else math.nan,
            episodes=eps, alarms=self.alarms, false_alarms=self.false_alarms, steps=self.steps)


@dataclass(frozen=True)
class Metrics:
    precision: float  # true alarms / alarms
    recall: float  # detected episodes / episodes
    recall_by_bucket: dict[tuple[float, float], float]
    false_alarms_per_1000: float  # per 1,000 steps of the whole job (all replicas together)
    latency_median: float  # steps from onset to the first flag, onset step counted as 1
    latency_mean: float
    predictor_mdape: float  # median absolute percentage error (fraction); nan for baselines
    episodes: int
    alarms: int
    false_alarms: int
    steps: int


def _bucket(f: float) -> tuple[float, float]:
    return next((b for b in BUCKETS if f < b[1]), BUCKETS[-1])


def replay(trace: Trace, method: Method, tally: Tally | None = None) -> Tally:
    """Run `method` over `trace`, adding to `tally` (a new one if None). Returns the tally."""
    tally = tally or Tally()
    cfg = trace.config
    det: Detector | None = getattr(method, "detector", None)
    flagged: dict[int, list[int]] = {r: [] for r in range(cfg.replicas)}  # steps each replica is flagged
    prev: set[int] = set()
    for s, timings in enumerate(trace.steps):
        if det is not None and det.predictor.ready():
            model = det.predictor.model()
            tally.ape += [abs(model.predict(m.tokens, m.sumsq) - m.seconds) / m.seconds
                          for r, mbs in timings.items() if trace.factor(r, s) == 1.0 for m in mbs]
        now = method(s, timings)
        for r in now:
            flagged[r].append(s)
        for r in now - prev:  # rising edge: an alarm
            tally.alarms += 1
            if not any(d.replica == r and d.onset <= s < d.end + cfg.grace for d in trace.slowdowns):
                tally.false_alarms += 1
        prev = now
    tally.steps += cfg.steps
    for d in trace.slowdowns:
        b = _bucket(d.factor)
        tally.episodes[b] += 1
        hit = next((s for s in flagged[d.replica] if d.onset <= s < d.end), None)
        if hit is not None:
            tally.detected[b] += 1
            tally.latencies.append(hit - d.onset + 1)
        tally.found.append((d.factor, math.nan if hit is None else hit - d.onset + 1))
    return tally


def recall_above(tally: Tally, factor: float) -> float:
    """Detected / episodes over the episodes of `factor` or more (nan if none)."""
    lat = [n for f, n in tally.found if f >= factor]
    return sum(not math.isnan(n) for n in lat) / len(lat) if lat else math.nan


def evaluate(cfg: TraceConfig, seeds: Sequence[int], methods: Mapping[str, Callable[[], Method]] = METHODS,
             tallies: dict[str, Tally] | None = None) -> dict[str, Tally]:
    """Every method on the same traces (one per seed), adding to `tallies` (new ones if None), so several
    scenarios can be summed. Returns the tallies by method name; `.metrics()` gives the rates."""
    tallies = tallies if tallies is not None else {}
    for seed in seeds:
        trace = generate(cfg, seed)
        for name, make in methods.items():
            replay(trace, make(), tallies.setdefault(name, Tally()))
    return tallies
