"""examples/hf_continue.py runs as a user runs it: a transformers Llama saved on disk, a run started from it
(--model.init_from) with validation loss and torch.compile through a replica kill, exported, and loaded back
by transformers: the kill fired, every validation was recorded, each replica compiled its blocks, and the
exported model predicts a line of Python better than the weights it started from (tests/runtime/
test_hf_export_e2e.py checks that a run starts from init_from's weights, bitwise)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.events import read_events, steps

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).parents[1] / "examples" / "hf_continue.py"


def test_the_hugging_face_example_continues_pretraining_and_round_trips(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "work")], cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=290)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    work = tmp_path / "work"
    events = read_events(work / "run")
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "fault"] == [(1, 3)]
    assert sorted(e["step"] for e in events if e["event"] == "eval") == [1, 3, 5, 7]
    assert {(e["replica"], e["compiled"]) for e in events if e["event"] == "parallelized"} == {(0, 2), (1, 2)}
    record = steps(events)
    assert sorted(record) == list(range(8)) and record[7]["members"] == [0]
    m = re.search(r"loaded LlamaForCausalLM: loss on a line of Python ([\d.]+) before, ([\d.]+) after", r.stdout)
    assert m, r.stdout[-2000:]
    assert float(m.group(2)) < float(m.group(1)), m.group(0)
    assert sorted(p.name for p in (work / "hf-out").iterdir()) == ["config.json", "model.safetensors"]
