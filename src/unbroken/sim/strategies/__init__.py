"""The recovery strategies the simulator compares, by name. Each is a `Run` subclass (base.py)."""
from __future__ import annotations

from unbroken.sim.strategies.base import Run
from unbroken.sim.strategies.detect import DetectOnly, LiveDetect
from unbroken.sim.strategies.drop import DropReplica
from unbroken.sim.strategies.live import Live
from unbroken.sim.strategies.replan import Replan
from unbroken.sim.strategies.restart import CheckpointRestart, InMemoryRestart

STRATEGIES: dict[str, type[Run]] = {cls.name: cls for cls in
                                    (CheckpointRestart, InMemoryRestart, DropReplica, Live, LiveDetect,
                                     DetectOnly, Replan)}
"""What each strategy keeps constant: True = every step reduces all M microbatches."""
CONSTANT_BATCH = {"checkpoint_restart": True, "in_memory_restart": True, "drop_replica": False,
                  "unbroken_live": True, "unbroken_detect": True, "detect_only": True, "unbroken_replan": True}
