"""Same seed, same event log byte for byte; another seed, another log."""
from __future__ import annotations

import pytest

from unbroken.sim.runner import simulate
from unbroken.sim.strategies import STRATEGIES


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_same_seed_same_log(small, strategy, tmp_path):
    a = simulate(small, strategy, seed=7, out=tmp_path / "a")
    b = simulate(small, strategy, seed=7, out=tmp_path / "b")
    assert a.digest == b.digest
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.end["tokens"] > 0
    c = simulate(small, strategy, seed=8)
    assert c.digest != a.digest


@pytest.mark.timeout(30)
def test_log_steps_and_aggregates_agree(small):
    for strategy in STRATEGIES:
        fine = simulate(small, strategy, seed=3, log_steps=True).end
        coarse = simulate(small, strategy, seed=3, aggregate_seconds=600).end
        assert {k: v for k, v in fine.items()} == coarse, strategy
