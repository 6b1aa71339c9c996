"""The workload-aware cost model: exact on clean data, robust to outliers, online refits, regime rescale."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.policy.predictor import CostModel, MicrobatchTiming, Predictor, fit_cost_model, median_ape

TRUTH = CostModel(a=2e-5, b=1e-8, c=5e-3)  # s/token, s/token^2, s/microbatch


def workload(rng: random.Random, n: int, truth: CostModel = TRUTH, noise: float = 0.0) -> list[MicrobatchTiming]:
    """`n` microbatches of 8 heavy-tailed documents (capped at 4,096 tokens), timed by `truth` * noise."""
    out = []
    for _ in range(n):
        lens = [min(4096, 1 + int(rng.lognormvariate(6.0, 1.3))) for _ in range(8)]
        t, q = sum(lens), float(sum(x * x for x in lens))
        out.append(MicrobatchTiming(t, q, truth.predict(t, q) * rng.lognormvariate(0.0, noise)))
    return out


def rel_diff(m1: CostModel, m2: CostModel, samples: list[MicrobatchTiming]) -> float:
    return max(abs(m1.predict(s.tokens, s.sumsq) / m2.predict(s.tokens, s.sumsq) - 1) for s in samples)


@settings(max_examples=30, deadline=None)
@given(a=st.floats(1e-6, 1e-4), b=st.floats(0, 1e-7), c=st.floats(0, 0.05), seed=st.integers(0, 10**6))
def test_noiseless_data_is_fit_exactly(a: float, b: float, c: float, seed: int) -> None:
    truth = CostModel(a, b, c)
    samples = workload(random.Random(seed), 40, truth)
    assert rel_diff(fit_cost_model(samples), truth, samples) < 1e-6


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), idx=st.integers(0, 119), factor=st.floats(3.0, 100.0))
def test_one_outlier_does_not_move_the_fit(seed: int, idx: int, factor: float) -> None:
    rng = random.Random(seed)
    clean = workload(rng, 120, noise=0.03)
    s = clean[idx]
    dirty = clean + [MicrobatchTiming(s.tokens, s.sumsq, s.seconds * factor)]
    probe = workload(rng, 50)
    # Tukey weights put the outlier at exactly 0; what is left is the robust scale's n -> n+1 change.
    assert rel_diff(fit_cost_model(dirty), fit_cost_model(clean), probe) < 2e-3


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.floats(0.1, 10.0))
def test_fit_scales_with_the_times(seed: int, k: float) -> None:
    """Every cost times k (a bigger model) gives predictions times k: the fit has no hidden units."""
    samples = workload(random.Random(seed), 60, noise=0.03)
    scaled = [MicrobatchTiming(s.tokens, s.sumsq, s.seconds * k) for s in samples]
    m, mk = fit_cost_model(samples), fit_cost_model(scaled)
    assert rel_diff(mk, m.scaled(k), samples) < 1e-4


def test_held_out_error_is_at_the_noise_level() -> None:
    rng = random.Random(7)
    model = fit_cost_model(workload(rng, 256, noise=0.03))
    err = median_ape(model, workload(rng, 500, noise=0.03))
    # Median |lognormal(0, 0.03) - 1| is about 0.0202; the fit adds little to it.
    assert 0.015 < err < 0.026
    with pytest.raises(ValueError):
        median_ape(model, [])


def test_coefficients_stay_non_negative_and_collinear_features_still_predict() -> None:
    # Every document 512 tokens: sumsq = 512 * tokens, so a and b cannot be told apart; predictions can.
    truth = CostModel(2e-5, 1e-8, 0.0)
    samples = [MicrobatchTiming(512 * n, 512.0 * 512 * n, truth.predict(512 * n, 512.0 * 512 * n))
               for n in range(1, 30)]
    m = fit_cost_model(samples)
    assert min(m.a, m.b, m.c) >= 0
    assert rel_diff(m, truth, samples) < 1e-6


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        fit_cost_model(workload(random.Random(0), 2))
    with pytest.raises(ValueError):
        MicrobatchTiming(10, 100.0, 0.0)
    with pytest.raises(ValueError):
        Predictor(window=8, min_samples=12)
    p = Predictor()
    assert not p.ready()
    with pytest.raises(LookupError):
        p.predict(100, 1e4)
    with pytest.raises(LookupError):
        p.rescale(2.0)


def test_online_predictor_fits_then_rescales_on_a_regime_change() -> None:
    rng = random.Random(3)
    p = Predictor(window=128, refit_every=32, min_samples=12)
    p.observe(workload(rng, 8, noise=0.03))
    assert not p.ready()  # 8 < min_samples
    p.observe(workload(rng, 8, noise=0.03))
    assert p.ready()
    for _ in range(10):
        p.observe(workload(rng, 32, noise=0.03))
    probe = workload(rng, 200)
    assert rel_diff(p.model(), TRUTH, probe) < 0.05
    assert p.model().step_time(probe[:4]) == pytest.approx(sum(p.predict(s.tokens, s.sumsq) for s in probe[:4]))
    # A model twice the size: rescale at once, then the first new-regime samples refit from scratch.
    p.rescale(2.0)
    assert rel_diff(p.model(), TRUTH.scaled(2.0), probe) < 0.05
    p.observe(workload(rng, 32, TRUTH.scaled(2.0), noise=0.03))
    assert rel_diff(p.model(), TRUTH.scaled(2.0), probe) < 0.05


def test_device_classes_are_fit_apart() -> None:
    rng = random.Random(5)
    p = Predictor()
    p.observe(workload(rng, 64, noise=0.01), "h100")
    p.observe(workload(rng, 64, TRUTH.scaled(3.0), noise=0.01), "a100")
    t, q = 6000, 2e7
    assert p.predict(t, q, "a100") / p.predict(t, q, "h100") == pytest.approx(3.0, rel=0.03)
    assert not p.ready("default")
