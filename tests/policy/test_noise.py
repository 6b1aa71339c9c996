"""The detector's thresholds follow the noise it measures: silent on a noisy healthy fleet, as fast as with
fixed thresholds at the design noise, and as late as policy/noise.py states on a noisy one."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from unbroken.policy.detection import Detector, DetectorConfig, Verdict
from unbroken.policy.noise import NoiseConfig, robust_sd, thresholds
from unbroken.policy.predictor import CostModel, MicrobatchTiming

pytestmark = pytest.mark.timeout(60)

TRUTH = CostModel(a=2e-5, b=1e-8, c=5e-3)


class Fleet:
    """Replicas of 4 microbatches a step, variable lengths, with a replica-step noise component (log-sd
    `noise`, AR(1) with lag-1 correlation 0.2, as measured on real runs) and 3% per microbatch."""

    def __init__(self, seed: int, replicas: int, noise: float):
        self.rng, self.replicas, self.noise = random.Random(seed), replicas, noise
        self.shared = [0.0] * replicas

    def step(self, slow: dict[int, float] | None = None) -> dict[int, list[MicrobatchTiming]]:
        out = {}
        for r in range(self.replicas):
            self.shared[r] = 0.2 * self.shared[r] + math.sqrt(1 - 0.04) * self.rng.gauss(0.0, self.noise)
            mbs = []
            for _ in range(4):
                lens = [min(4096, 1 + int(self.rng.lognormvariate(6.0, 1.3))) for _ in range(8)]
                t, q = sum(lens), float(sum(x * x for x in lens))
                f = (slow or {}).get(r, 1.0) * math.exp(self.shared[r] + self.rng.gauss(0.0, 0.03))
                mbs.append(MicrobatchTiming(t, q, TRUTH.predict(t, q) * f))
            out[r] = mbs
        return out


def run(det: Detector, fleet: Fleet, steps: range, slow: dict[int, float] | None = None) -> list[tuple[int, int]]:
    """Observe `steps`; returns the (step, replica) of each Slow verdict."""
    out = []
    for s in steps:
        for r, v in det.observe(s, fleet.step(slow)).items():
            if v is Verdict.SLOW and (not out or out[-1][1] != r):
                out.append((s, r))
    return out


def test_at_the_design_noise_the_thresholds_are_the_fixed_ones():
    cfg = DetectorConfig()
    for noise in (0.0, 0.03, 0.05, 0.064):
        assert _levels(thresholds(noise, cfg.base(), cfg.noise)) == _levels(cfg.base()), noise
    noisy = thresholds(0.15, cfg.base(), cfg.noise)
    assert (noisy.drift, noisy.suspect_at, noisy.slow_at, noisy.recover_below) == pytest.approx((0.15, 0.3, 1.05, 0.15))
    assert noisy.max_increment == pytest.approx(0.7)  # one step alone still reaches 2/3 of Slow at most
    # the latencies the module docstring states
    assert [cfg.base().latency(f) for f in (1.3, 1.6, 3.0)] == [3, 2, 2]
    assert [noisy.latency(f) for f in (1.3, 1.5, 2.0)] == [10, 5, 2]
    at_02 = thresholds(0.2, cfg.base(), cfg.noise)
    assert [at_02.latency(f) for f in (1.2, 1.3, 1.5, 2.0)] == [math.inf, 23, 7, 3]


def _levels(th):
    return (th.drift, th.suspect_at, th.slow_at, th.max_increment, th.recover_below)


def test_the_noise_estimate_is_the_sd_and_one_hiccup_moves_it_little():
    rng = random.Random(3)
    xs = [rng.gauss(0.0, 0.1) for _ in range(64)]
    assert robust_sd(xs) == pytest.approx(0.1, rel=0.2)
    assert robust_sd(xs[:-1] + [3.0]) < 1.15 * robust_sd(xs)  # a 20x step is one clipped sample
    # scores normalized by a fleet of 4's median crowd near it (two of four sit beside it every step):
    # the sd is read, where the MAD-based sd reads ~0.8 of it
    crowd = []
    for _ in range(60):
        step = [rng.gauss(0, 0.15) for _ in range(4)]
        crowd += [v - statistics.median(step) for v in step]
    assert robust_sd(crowd) == pytest.approx(statistics.pstdev(crowd), rel=0.1)
    # a fleet of 2 is normalized by its faster replica: half the scores are exactly 0
    pair = [v for _ in range(40) for v in (0.0, abs(rng.gauss(0, 0.15)))]
    assert robust_sd(pair) == pytest.approx(statistics.pstdev(pair), rel=0.1)


@pytest.mark.parametrize("replicas", [4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_healthy_fleet_is_measured_noisy_and_nobody_is_declared_slow(seed: int, replicas: int):
    """Replica-step noise 0.15, the worst measured on this host under load (3x the design noise): with
    the fixed thresholds a healthy replica is declared Slow within 400 steps, with adaptive ones never."""
    fixed = DetectorConfig(noise=NoiseConfig(drift_sigmas=0, suspect_sigmas=0, slow_sigmas=0, recover_sigmas=0))
    assert run(Detector(fixed), Fleet(seed, replicas, 0.15), range(400))
    det = Detector()
    assert run(det, Fleet(seed, replicas, 0.15), range(400)) == []
    # the score is the replica's against the fleet's median: its sd is a little under the noise put in
    # (the fleet's estimate raised by its margin, x1.13 over 4 replicas' window of 64 steps)
    assert 0.1 <= det.fleet_noise()["default"] <= 0.18
    assert all(0.1 <= v <= 0.18 * det.config.noise.cap for v in det.noise().values())


def test_a_1_3x_slowdown_at_the_design_noise_is_slow_within_3_steps():
    """Replica-step noise 0.05: the fixed thresholds hold, and 1.3x is Slow on its 3rd step (their
    noiseless latency) in the median episode, by twice that in every one. Not by `latency(1.3, z=3)`
    (5) in every one: seed 0 took 6, its replica's scores at 0.11-0.15 over its first 4 slow steps
    (Gaussian noise of 0.05 about 0.26 does not explain it; the slowed replica is still Healthy then and
    teaches the predictor, which the stated latency does not model)."""
    latencies = []
    for seed in range(8):
        det, fleet, victim = Detector(), Fleet(seed, 4, 0.05), seed % 4
        assert run(det, fleet, range(30)) == []
        th = det.thresholds(victim)
        assert _levels(th) == _levels(det.config.base()), th
        slow = run(det, fleet, range(30, 40), {victim: 1.3})
        assert slow and slow[0][1] == victim, slow
        latencies.append(slow[0][0] - 30 + 1)
    assert det.config.base().latency(1.3) == 3
    assert statistics.median(latencies) <= 3 and max(latencies) <= 6, latencies


def test_a_1_3x_slowdown_at_0_15_noise_takes_the_stated_latency():
    """Replica-step noise 0.15: each episode declared Slow after its onset, on the slowed replica, within
    `latency(1.3, z=3)` of the thresholds in force at the onset; their median near the noiseless
    `latency(1.3)` (10 steps at a measured noise of 0.15)."""
    latencies, stated = [], []
    for seed in range(8):
        det, fleet, victim = Detector(), Fleet(seed, 4, 0.15), seed % 4
        assert run(det, fleet, range(60)) == []
        th = det.thresholds(victim)
        slow = run(det, fleet, range(60, 100), {victim: 1.3})
        assert slow and slow[0][1] == victim, (seed, slow)
        latencies.append(slow[0][0] - 60 + 1)
        stated.append(th.latency(1.3))
        assert latencies[-1] <= th.latency(1.3, z=3), (seed, latencies[-1], th)
    assert abs(statistics.median(latencies) - statistics.median(stated)) <= 3, (latencies, stated)
