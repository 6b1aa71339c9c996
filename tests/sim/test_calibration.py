"""The simulator predicts a small real run's wall time within 15% (runs the real trainer)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from unbroken.sim.calibrate import predict


@pytest.mark.timeout(170)
def test_calibrated_prediction_of_a_real_run(tmp_path):
    if importlib.util.find_spec("unbroken.runtime.trainer") is None:
        pytest.skip("unbroken.runtime.trainer is not there yet")
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "unbroken.cli", "train", "--replicas", "2", "--steps", "6",
                    "--microbatches", "4", "--out", str(out)], check=True, timeout=150,
                   stdout=subprocess.DEVNULL)
    p = predict(out)
    step_tokens = p.measured_tokens // 6
    # tokens committed by the measured wall time: within one step of the real count
    assert p.measured_tokens > 0 and abs(p.predicted_tokens - p.measured_tokens) <= step_tokens
    assert p.wall_error < 0.15, p
