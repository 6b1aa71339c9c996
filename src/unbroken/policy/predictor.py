"""Workload-aware time predictor: what a microbatch should cost, from the work it holds.

Owns: the cost model `seconds = a * tokens + b * sum(len^2) + c` (linear layers scale with tokens,
attention with the square of each sequence's length), its robust fit, an online fleet-wide fit per
device class over a sliding window, and the held-out error measure.
Does not own: deciding who is slow (detection.py), measuring time (the trainer's timing hooks), or which
samples are trustworthy: the caller (the detector) feeds only samples of replicas it believes healthy,
so a slow replica does not teach the model that slowness is normal.

The fit is iteratively reweighted least squares on *relative* residuals (timing noise is multiplicative),
Huber weights from a cold start then Tukey bisquare weights, so a far outlier ends with weight exactly
zero and does not move the fit. Coefficients are kept non-negative (no work costs negative time).
Pure: no clock, no I/O, no numpy; a refit costs O(window), a prediction O(1).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_HUBER_K = 1.345  # Huber tuning constant, in robust-scale units (95% efficiency under Gaussian noise)
_TUKEY_C = 4.685  # bisquare tuning constant, same units; residuals beyond it get weight 0
_MIN_SCALE = 0.002  # floor of the robust relative scale (0.2%), so noiseless data does not divide by 0
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True, slots=True)
class MicrobatchTiming:
    """One computed microbatch: its work features and how long its forward+backward took."""
    tokens: int  # tokens in the microbatch
    sumsq: float  # sum over its sequences (documents) of length^2, tokens^2
    seconds: float  # measured compute time, s (a replica group's: its slowest rank's, which it waits for)
    ranks: tuple[float, ...] = ()  # a group of several ranks: each rank's own device seconds, by rank

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sumsq < 0 or not self.seconds > 0:
            raise ValueError(f"bad timing {self}: features must be >= 0 and seconds > 0")


@dataclass(frozen=True, slots=True)
class CostModel:
    a: float  # s per token
    b: float  # s per token^2 (attention)
    c: float  # s per microbatch (launches, fixed overheads)

    def predict(self, tokens: float, sumsq: float) -> float:
        """Predicted seconds of one microbatch (never below 1 ns, so ratios stay finite)."""
        return max(self.a * tokens + self.b * sumsq + self.c, 1e-9)

    def step_time(self, microbatches: Iterable[MicrobatchTiming | tuple[float, float]]) -> float:
        """Predicted compute time of one replica's step: the sum over its microbatches, which run one
        after another. (With pipeline stages this becomes the critical path; not modelled yet.)"""
        total = 0.0
        for m in microbatches:
            t, q = (m.tokens, m.sumsq) if isinstance(m, MicrobatchTiming) else m
            total += self.predict(t, q)
        return total

    def scaled(self, factor: float) -> CostModel:
        return CostModel(self.a * factor, self.b * factor, self.c * factor)


class SameWork(Sequence[MicrobatchTiming]):
    """One replica-step's microbatches that all hold the same work (`tokens`, `sumsq`): only their seconds
    differ. A `Sequence[MicrobatchTiming]` (item i is `MicrobatchTiming(tokens, sumsq, seconds[i])`), so it
    goes wherever a list of timings does; the detector scores it without building those objects (one
    prediction instead of one per microbatch, the same arithmetic). The simulator's timings are of this
    form (fixed-length microbatches); the runtime's are plain lists."""

    __slots__ = ("tokens", "sumsq", "seconds")

    def __init__(self, tokens: int, sumsq: float, seconds: Sequence[float]):
        if tokens < 0 or sumsq < 0 or (len(seconds) and not min(seconds) > 0):
            raise ValueError(f"bad timings ({tokens}, {sumsq}, {seconds}): features must be >= 0 and seconds > 0")
        self.tokens, self.sumsq, self.seconds = tokens, sumsq, tuple(seconds)

    def __len__(self) -> int:
        return len(self.seconds)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [MicrobatchTiming(self.tokens, self.sumsq, x) for x in self.seconds[i]]
        return MicrobatchTiming(self.tokens, self.sumsq, self.seconds[i])

    def __repr__(self) -> str:
        return f"SameWork({self.tokens}, {self.sumsq}, {self.seconds})"


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence (O(n log n)). Raises IndexError when empty."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _normal_equations(rows: Sequence[tuple[float, float, float]], ys: Sequence[float], ws: Sequence[float]
                      ) -> tuple[list[list[float]], list[float]]:
    """X'WX (3x3) and X'Wy of a weighted least-squares problem; one pass, unrolled for speed."""
    a00 = a01 = a02 = a11 = a12 = a22 = v0 = v1 = v2 = 0.0
    for (x0, x1, x2), y, w in zip(rows, ys, ws):
        if w == 0.0:
            continue
        w0, w1, w2 = w * x0, w * x1, w * x2
        a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2
        a11 += w1 * x1; a12 += w1 * x2; a22 += w2 * x2
        v0 += w0 * y; v1 += w1 * y; v2 += w2 * y
    return [[a00, a01, a02], [a01, a11, a12], [a02, a12, a22]], [v0, v1, v2]


def _solve(A: list[list[float]], v: list[float], active: list[int]) -> list[float]:
    """Solve the normal equations restricted to the `active` columns (Gaussian elimination with partial
    pivoting). A column whose pivot vanishes (collinear features) is left at 0."""
    k = len(active)
    M = [[A[i][j] for j in active] for i in active]
    b = [v[i] for i in active]
    trace = sum(M[i][i] for i in range(k)) or 1.0
    for i in range(k):
        M[i][i] += 1e-12 * trace  # tiny ridge: conditioning only, far below any real signal
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(M[r][col]))
        M[col], M[piv], b[col], b[piv] = M[piv], M[col], b[piv], b[col]
        if abs(M[col][col]) < 1e-10 * trace:
            continue
        for r in range(col + 1, k):
            f = M[r][col] / M[col][col]
            for j in range(col, k):
                M[r][j] -= f * M[col][j]
            b[r] -= f * b[col]
    beta = [0.0] * k
    for col in reversed(range(k)):
        if abs(M[col][col]) >= 1e-10 * trace:
            beta[col] = (b[col] - sum(M[col][j] * beta[j] for j in range(col + 1, k))) / M[col][col]
    return beta


def _nonneg_fit(rows: Sequence[tuple[float, float, float]], ys: Sequence[float], ws: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0: drop the most negative column and re-solve (3 columns,
    so this active-set loop ends after at most 3 solves of at most 3x3)."""
    A, v = _normal_equations(rows, ys, ws)
    active = [0, 1, 2]
    while active:
        sol = _solve(A, v, active)
        worst = min(range(len(active)), key=lambda i: sol[i])
        if sol[worst] >= 0:
            full = [0.0, 0.0, 0.0]
            for j, x in zip(active, sol):
                full[j] = x
            return full
        active.pop(worst)
    return [0.0, 0.0, 0.0]


def fit_cost_model(samples: Sequence[MicrobatchTiming], start: CostModel | None = None,
                   max_iter: int = 30) -> CostModel:
    """Robust fit of `CostModel` to `samples`.

    Call whenever a fresh fit is wanted (the `Predictor` calls it on its window). `start` is a previous
    fit to warm-start from: then only Tukey iterations run and few are needed. Costs O(len(samples)) per
    iteration. Raises ValueError with fewer than 3 samples (3 coefficients).
    """
    n = len(samples)
    if n < 3:
        raise ValueError(f"need at least 3 samples to fit 3 coefficients, got {n}")
    # Scale columns to O(1) so the normal equations are well conditioned (tokens ~1e4, sumsq ~1e8).
    st = sum(s.tokens for s in samples) / n or 1.0
    sq = sum(s.sumsq for s in samples) / n or 1.0
    rows = [(s.tokens / st, s.sumsq / sq, 1.0) for s in samples]
    ys = [s.seconds for s in samples]
    if start is None:
        beta = _nonneg_fit(rows, ys, [1.0 / (y * y) for y in ys])  # relative least squares
        huber_iters = 5
    else:
        beta = [start.a * st, start.b * sq, start.c]
        huber_iters = 0
    for it in range(max_iter):
        b0, b1, b2 = beta
        # max(v, 1e-9) spelled out (the same value, NaN included): this loop runs on every step's refit
        preds = [1e-9 if 1e-9 > (v := x0 * b0 + x1 * b1 + x2 * b2) else v for x0, x1, x2 in rows]
        rel = [(y - p) / p for y, p in zip(ys, preds)]
        scale = max(_MAD_TO_SIGMA * median(list(map(abs, rel))), _MIN_SCALE)
        if it < huber_iters:
            wr = [min(1.0, _HUBER_K * scale / abs(r)) if r else 1.0 for r in rel]
        else:
            cut = _TUKEY_C * scale
            wr = [(1.0 - (r / cut) ** 2) ** 2 if abs(r) < cut else 0.0 for r in rel]
            if sum(1 for w in wr if w > 0) < 3:  # a bad start would reject nearly everything: fall back
                wr = [min(1.0, _HUBER_K * scale / abs(r)) if r else 1.0 for r in rel]
        new = _nonneg_fit(rows, ys, [w / (p * p) for w, p in zip(wr, preds)])
        moved = max(abs(a - b) for a, b in zip(new, beta)) / (max(abs(b) for b in new) or 1.0)
        beta = new
        if it >= huber_iters and moved < 1e-7:  # 1e-7 relative: far below timing noise
            break
    return CostModel(beta[0] / st, beta[1] / sq, beta[2])


def median_ape(model: CostModel, samples: Iterable[MicrobatchTiming]) -> float:
    """Median absolute percentage error (as a fraction: 0.03 = 3%) of `model` on held-out `samples`.
    Raises ValueError when `samples` is empty."""
    errs = [abs(model.predict(s.tokens, s.sumsq) - s.seconds) / s.seconds for s in samples]
    if not errs:
        raise ValueError("no samples to score")
    return median(errs)


class Predictor:
    """Online, fleet-wide cost model, one per device class, refit over a sliding window of samples.

    Calling contract: once per step, `observe` the samples of the replicas believed healthy; `predict`
    any time after `ready(cls)`. On a regime change (every replica's cost moved together: a new model
    size, a new kernel) call `rescale(factor, cls)`: predictions follow at once and the window restarts,
    so the next refit uses only new-regime samples.
    """

    def __init__(self, window: int = 256, refit_every: int = 64, min_samples: int = 12):
        if window < min_samples or min_samples < 3 or refit_every < 1:
            raise ValueError("need window >= min_samples >= 3 and refit_every >= 1")
        self.window = window  # samples kept per class: a few steps of the fleet, enough for 3 coefficients
        self.refit_every = refit_every  # new samples between refits: bounds refit cost per step
        self.min_samples = min_samples
        self._samples: dict[str, deque[MicrobatchTiming]] = {}
        self._fresh: dict[str, int] = {}
        self._models: dict[str, CostModel] = {}
        self._pending: set[str] = set()  # classes rescaled and not refit since

    def observe(self, samples: Iterable[MicrobatchTiming], device_class: str = "default") -> None:
        """Add samples of `device_class` to its window. Call once per step with the healthy replicas'
        samples. Refits when `refit_every` new ones arrived, or as soon as `min_samples` are held while the
        class has no fit for its current regime (first samples, or after `rescale`). O(samples + window)."""
        win = self._samples.setdefault(device_class, deque(maxlen=self.window))
        new = samples if isinstance(samples, Sequence) else list(samples)
        win.extend(new[max(0, len(new) - self.window):])  # the window keeps only the last `window` anyway
        fresh = self._fresh.get(device_class, 0) + len(new)
        # Refit when enough new samples arrived, or at once when the class has no fit for its current
        # regime (first samples, or just after `rescale`).
        due = fresh >= self.refit_every or device_class in self._pending or device_class not in self._models
        if due and len(win) >= self.min_samples:
            # Warm refits stop after a few iterations: the window moved by only `refit_every` samples, and
            # the next refit continues from here, so the fit tracks the fixed point across steps.
            warm = self._models.get(device_class)
            self._models[device_class] = fit_cost_model(list(win), start=warm, max_iter=4 if warm else 30)
            self._pending.discard(device_class)
            fresh = 0
        self._fresh[device_class] = fresh

    def ready(self, device_class: str = "default") -> bool:
        return device_class in self._models

    def model(self, device_class: str = "default") -> CostModel:
        """The current fit. Raises LookupError before `min_samples` samples of the class were observed."""
        try:
            return self._models[device_class]
        except KeyError:
            raise LookupError(f"no cost model yet for device class {device_class!r}") from None

    def predict(self, tokens: float, sumsq: float, device_class: str = "default") -> float:
        """Predicted seconds of one microbatch. Raises LookupError before the class is `ready`."""
        return self.model(device_class).predict(tokens, sumsq)

    def rescale(self, factor: float, device_class: str = "default") -> None:
        """Regime change: every cost of the class moved by `factor`. Scales the model and empties the window.
        Raises LookupError before the class is `ready`, ValueError for a factor <= 0."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        self._models[device_class] = self.model(device_class).scaled(factor)
        self._samples[device_class].clear()
        self._fresh[device_class] = 0
        self._pending.add(device_class)
