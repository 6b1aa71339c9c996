"""The simulator, calibrated on one real run, predicts another real run with other faults within 15%.

Calibration run: 2 replicas, 8 steps, replica 1 killed in step 3's compute. Predicted run: 12 steps,
replica 0 killed in step 7's all-reduce. The prediction reads every cost off the first run's log and
of the second only its configuration and fault spec (sim/calibrate.predict_other), so the second
run's timings cannot leak into its own prediction. 2 replicas on 2 cores: one replica a core before
and after the kill, as the simulator assumes (a replica's speed does not change when a peer dies)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from unbroken.events import read_events
from unbroken.sim.calibrate import predict_other

COMMON = ["--replicas", "2", "--microbatches", "8", "--run.progress=false", "--coord.heartbeat_timeout=1.0",
          "--coord.heartbeat_interval=0.1"]


def train(out, steps: int, faults: str) -> None:
    subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *COMMON, "--steps", str(steps), "--faults",
                    faults, "--out", str(out)], check=True, timeout=120, stdout=subprocess.DEVNULL)
    fired = [e for e in read_events(out) if e["event"] == "fault"]
    dead = [e["replica"] for e in read_events(out) if e["event"] == "member_dead"]
    assert len(fired) == 1 and dead == [fired[0]["replica"]]  # the kill fired and took its replica


@pytest.mark.slow
@pytest.mark.timeout(250)
def test_calibrated_on_one_run_predicts_another_with_faults(tmp_path):
    train(tmp_path / "cal", 8, "kill:replica=1,step=3,phase=compute")
    train(tmp_path / "target", 12, "kill:replica=0,step=7,phase=allreduce")
    p = predict_other(tmp_path / "cal", tmp_path / "target")
    assert p.measured_tokens == p.predicted_tokens  # every step of the target committed, as predicted
    assert p.wall_error < 0.15, p
