"""The documented persistence commands work as written: the block under "## Commands that exercise them" in
docs/persistence.md is run as a user would (in a fresh directory, `unbroken` being the installed CLI), and its
faults had their effects."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.docblocks import section_blocks
from unbroken.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def persistence_block() -> str:
    blocks = section_blocks("docs/persistence.md", "## Commands that exercise them")
    assert len(blocks) == 1, "the persistence section holds one bash block"
    return blocks[0]


def test_persistence_commands_run_as_written(tmp_path):
    script = f'set -e\nunbroken() {{ "{sys.executable}" -m unbroken.cli "$@"; }}\n' + persistence_block()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    lines = r.stdout.splitlines()
    assert lines.count("identical: 8/8 steps") == 3 and lines.count("identical: 40/40 steps") == 1, r.stdout[-3000:]
    assert lines.count("audit: 0 problems") == 4, r.stdout[-3000:]
    snap = read_events(tmp_path / "runs" / "snap")
    kinds = [(e["event"], e.get("kind")) for e in snap]
    assert ("fault", "corrupt") in kinds and ("fault", "crash-all") in kinds and ("restart", None) in kinds
    assert {e["source"] for e in snap if e["event"] == "restored"} == {"memory"}
    assert any(e["event"] == "shard_rejected" and e["rebuilt"] for e in snap)  # the flipped shard: rebuilt
    disk = read_events(tmp_path / "runs" / "disk")
    assert {e["source"] for e in disk if e["event"] == "restored"} == {"disk"}
    # restart-memory: the kill restarted every trainer, which reloaded a snapshot
    mem = read_events(tmp_path / "runs" / "mem")
    assert ("fault", "kill") in [(e["event"], e.get("kind")) for e in mem]
    assert [e["source"] for e in mem if e["event"] == "restart"] == ["memory"]
    assert {e["source"] for e in mem if e["event"] == "restored"} == {"memory"}
    # resume: the first launcher ended with its coordinator lost before the last step; `resume` began a
    # new generation in the same log that restored the same step on both replicas and finished
    cut = read_events(tmp_path / "runs" / "cut")
    ends = [e for e in cut if e["event"] == "run_end"]
    assert len(ends) == 2 and not ends[0]["ok"] and "coordinator was lost" in ends[0]["error"] and ends[1]["ok"]
    first = cut.index(ends[0])
    assert max(e["step"] for e in cut[:first] if e["event"] == "step") < 39  # cut short: something to resume
    assert [e.get("resumed") for e in cut if e["event"] == "restart"] == [True]
    restored = {(e["source"], e["step"]) for e in cut[first:] if e["event"] == "restored"}
    assert len(restored) == 1 and restored.pop()[0] == "memory", restored  # both replicas: one snapshot
