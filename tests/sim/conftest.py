"""A small scenario with every failure scope at high rates, so a day of virtual time exercises everything."""
from __future__ import annotations

import pytest

from unbroken.sim.scenario import Scenario, from_tree


def small_tree(**over: object) -> dict:
    tree = {
        "name": "small",
        "cluster": {"dp": 6, "tp": 2, "pp": 2, "gpus_per_node": 8},
        "workload": {"microbatches": 24, "tokens_per_microbatch": 1000, "microbatch_seconds": 0.5,
                     "sync_seconds": 0.2, "duration_hours": 24.0},
        "costs": {"detect_seconds": 5.0, "reform_seconds": 1.0, "restart_seconds": 60.0, "reload_seconds": 30.0,
                  "checkpoint_seconds": 5.0, "snapshot_seconds": 0.02, "memory_restore_seconds": 5.0,
                  "rejoin_seconds": 20.0, "replace_seconds": 3600.0},
        # small enough that a group of 4 ranks can shrink to 2 or 3 of them (unbroken_replan)
        "model": {"layers": 8, "state_gb_per_layer": 1.0, "activation_bytes_per_token": 2048.0},
        "cause": [
            {"name": "gpu", "scope": "gpu", "count": 10, "over_gpus": 24, "over_hours": 24.0},
            {"name": "node", "scope": "node", "count": 3, "over_gpus": 24, "over_hours": 24.0},
            {"name": "sw", "scope": "software", "count": 3, "over_gpus": 24, "over_hours": 24.0},
            {"name": "slow", "scope": "slow", "count": 6, "over_gpus": 24, "over_hours": 24.0, "factor": 3.0,
             "duration_seconds": 1800.0},
        ],
    }
    tree.update(over)
    return tree


@pytest.fixture
def small() -> Scenario:
    return from_tree(small_tree())
