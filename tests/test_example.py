"""examples/custom_model.py — a model, data class and optimizer defined outside the package — trains through
`unbroken.train` as a user runs it (the launcher re-runs the script as each replica), survives a replica
killed mid-all-reduce, and leaves a run directory whose summary says ok with every microbatch reduced
exactly once. The example also keeps its promise of fewer than 30 lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.trainer.test_recovery_e2e import assert_killed
from unbroken.events import read_events
from unbroken.observe.runs import audit

EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_model.py"


def test_example_is_short():
    lines = EXAMPLE.read_text().splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    assert len(lines) < 30 and 'if __name__ == "__main__":' in EXAMPLE.read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_custom_model_survives_a_kill(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "UNBROKEN_FAULTS": "kill:replica=1,step=3,phase=allreduce", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(EXAMPLE), str(out)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok=True steps=12" in r.stdout, r.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["steps_committed"] == 12 and summary["members_lost"] == 1, summary
    assert summary["faults"] == 1
    events = read_events(out)
    # the kill fired in replica 1's step-3 all-reduce, and took it out: declared dead, absent from the
    # members of step 3 and every later step
    assert_killed(events, (1, 3, "allreduce"))
    # ...and step 3 committed without it: none of its microbatches reduced by replica 1
    step3 = next(e for e in events if e["event"] == "step" and e["step"] == 3)
    assert "1" not in step3["owners"] and 1 not in step3["members"], step3
    # it learned: a model that never learns stays near ln(256) = 5.545, its loss at step 0
    losses = [e["loss"] for e in sorted(read_events(out), key=lambda e: e.get("step", -1)) if e["event"] == "step"]
    assert losses[0] > 5.0 and summary["final_loss"] < losses[0] - 1.0, losses
    assert audit(out, 4) == []
