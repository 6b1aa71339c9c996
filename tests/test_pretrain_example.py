"""The documented pre-training job runs as written (docs/pretraining.md, examples/pretrain.toml): token shards
made by prepare-data, warmup + cosine, clipping, bf16, activation checkpointing, 2 groups x 2 FSDP2 ranks, a
rank killed and its group restarted by torchrun and healed; the run ends clean, the fault fired and had its
effect, and every step stepped at its schedule's lr."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.docblocks import ROOT, marked_lines
from unbroken.config import Config
from unbroken.events import read_events, steps
from unbroken.model.optim import lr_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_pretraining_example_runs_as_documented(tmp_path, monkeypatch):
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "pretrain.toml", tmp_path / "examples")
    block = "\n".join(marked_lines("docs/pretraining.md", "pretrain"))
    script = (f'set -e\nunbroken() {{ "{sys.executable}" -m unbroken.cli "$@"; }}\n'
              f'python3() {{ "{sys.executable}" "$@"; }}\n' + block + "\n")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                       capture_output=True, text=True, timeout=290)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "audit: 0 problems" in r.stdout, r.stdout[-2000:]
    out = tmp_path / "runs" / "pretrain"
    events = read_events(out)
    kill = [e for e in events if e["event"] == "fault" and e.get("kind") == "kill"]
    assert [(e["replica"], e.get("rank")) for e in kill] == [(1, 1)]
    assert any(e["event"] == "join" and e["replica"] == 1 for e in events), "the restarted group never rejoined"
    assert sorted(e["side"] for e in events if e["event"] == "heal") == ["donor", "donor", "joiner", "joiner"]
    monkeypatch.chdir(tmp_path)  # data.path is relative to where the job was started
    cfg = Config.from_json((out / "config.json").read_text())
    assert (cfg.parallel.mixed_precision, cfg.model.activation_checkpointing) == ("bf16", "selective")
    record = steps(events)
    assert sorted(record) == list(range(cfg.run.steps))
    assert [record[s]["lr"] for s in record] == [lr_at(s, cfg.optim, cfg.run.steps) for s in record]
    assert all(math.isfinite(record[s]["grad_norm"]) for s in record)
    assert record[cfg.run.steps - 1]["members"] == [0, 1]
    assert record[cfg.run.steps - 1]["loss"] < record[0]["loss"]
