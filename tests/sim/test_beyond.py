"""Every simulated run says what it models that the runtime cannot do yet (sim/beyond.py), in run_start."""
from __future__ import annotations

import pytest

from unbroken.sim.beyond import BEYOND_RUNTIME
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, keys", [
    # TP 8 alone: the runtime has TP groups, their snapshots and checkpoints; not many hosts
    ("scenarios/recover_512.toml", ["hosts"]),
    # TP 8 x PP 4: the runtime has both inside a group (TP inside stages), rejoin and persistence; these
    # strategies do not re-plan groups
    ("scenarios/resihp_256_failstop.toml", ["hosts"]),
])
def test_run_start_names_what_the_runtime_cannot_do(path, keys):
    for strategy in ("unbroken_live", "checkpoint_restart"):
        recs = simulate(load(path), strategy, seed=0, keep=True, aggregate_seconds=3600).records
        start = next(r for r in recs if r["event"] == "run_start")
        assert start["beyond_runtime"] == [BEYOND_RUNTIME[k] for k in keys]


@pytest.mark.timeout(60)
def test_a_replanning_run_labels_layer_moves_as_beyond_the_runtime(small):
    # the runtime does not move layers between stages yet: a run that may re-partition says so up front
    recs = simulate(small, "unbroken_replan", seed=0, keep=True).records
    start = recs[0]
    assert BEYOND_RUNTIME["replanning"] in start["beyond_runtime"]
    assert "moving layers off a slow stage" in BEYOND_RUNTIME["replanning"]
    kinds = {r["decision"] for r in recs if r["event"] == "group_plan"}
    assert kinds  # the scheduler was called and its decisions logged beside that label
