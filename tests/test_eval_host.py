"""The host's premise as the detector's real-process tests measure it (eval/host.py): from raw compute
records alone, the noise of device time about an offline cost-model fit and a replica's slowdown.
Synthetic records: 4 replicas, 2 microbatches a step, variable lengths (the fit must explain them)."""
from __future__ import annotations

import math
import random

import pytest

from unbroken.eval import host

pytestmark = pytest.mark.timeout(30)


def records(noise: float, slow_replica: int = -1, factor: float = 1.0, steps: range = range(0), seed: int = 0):
    rng = random.Random(seed)
    out = []
    for step in range(40):
        for replica in range(4):
            shared = rng.gauss(0.0, noise)  # the replica-step's noise, shared by its microbatches
            for i in range(2):
                tokens = rng.randrange(256, 2048)
                sumsq = tokens * tokens / rng.choice((1, 2, 4))
                seconds = (1e-4 * tokens + 2e-8 * sumsq + 0.002) * math.exp(shared + rng.gauss(0.0, 0.01))
                if replica == slow_replica and step in steps:
                    seconds *= factor
                out.append({"event": "compute", "step": step, "replica": replica, "microbatch": i,
                            "tokens": tokens, "sumsq": sumsq, "seconds": seconds})
    return out


@pytest.mark.parametrize("noise", [0.03, 0.1, 0.2])
def test_the_noise_of_device_time_is_measured_from_the_records(noise: float):
    res = host.residuals(records(noise, seed=int(noise * 100)))
    assert sorted(res) == list(range(2, 40))  # the run's first 2 steps are its start-up, not its noise
    # a replica's residual is against the step's median over 4 replicas: a little under the noise put in
    assert 0.6 * noise <= host.noise(res) <= 1.1 * noise


def test_a_slowed_replica_s_factor_is_read_and_its_steps_can_be_left_out_of_the_noise():
    recs = records(0.05, slow_replica=2, factor=1.3, steps=range(10, 20))
    res = host.residuals(recs)
    assert host.slowdown(res, 2, range(10, 20)) == pytest.approx(1.3, rel=0.06)
    assert host.slowdown(res, 1, range(10, 20)) == pytest.approx(1.0, abs=0.06)
    assert host.slowdown(res, 2, range(100, 110)) == 1.0  # steps the records lack
    # the slowed steps are not noise: left out, the figure is the noise put in (0.05, less the fleet's
    # median's share), counted in, 10 steps of a 1.3x read as noise
    quiet = host.noise(res, lambda s, r: r == 2 and 10 <= s < 20)
    assert 0.035 <= quiet <= 0.05 and host.noise(res) > 1.2 * quiet
    assert math.isnan(host.noise({}))
