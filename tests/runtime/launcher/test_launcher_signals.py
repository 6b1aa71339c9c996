"""The launcher stopped from outside: `kill PID` (SIGTERM) ends the run as Ctrl-C does, children included.

A scheduler that preempts a job, or a user who types `kill`, sends SIGTERM to the launcher. Python's
default action ends it at once, which left the coordinator and every trainer running on, orphaned (the
trainers kept training against the coordinator's store). Real processes, a real signal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.events import read_events
from unbroken.runtime.launcher.processes import process_tree

pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_sigterm_to_the_launcher_stops_every_child_and_exits_non_zero(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", "2", "--steps", "400",
           "--microbatches", "2", "--run.progress=false", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not any(
            e["event"] == "step" for e in (read_events(out) if (out / "events.jsonl").exists() else [])):
        time.sleep(0.1)
    named = [int((out / "logs" / f"{who}.pid").read_text()) for who in ("replica0", "replica1", "coordinator")]
    children = process_tree(proc.pid)[1:]  # those and the fork server they came from
    assert set(named) <= set(children) and len(children) == 4 and all(alive(p) for p in children), children

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == "unbroken: error: interrupted"
    gone_by = time.time() + 10
    while time.time() < gone_by and any(alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "children outlived the launcher"
    assert (out / "summary.json").exists()  # ended, not cut off: the summary is written


@pytest.mark.timeout(120)
def test_a_lost_coordinator_ends_the_run_with_one_line_and_a_summary(tmp_path):
    """kill -9 of the coordinator mid-run: the launcher notices, kills the trainers, writes summary.json and
    ends with one line naming the last committed step, and exit 1 (before: a C++ trace and no summary)."""
    import json as _json
    import signal as _signal
    import time as _time

    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "train", "--replicas", "2", "--steps", "400",
                          "--microbatches", "4", "--run.progress=false", "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = out / "events.jsonl"
        deadline = _time.monotonic() + 90
        while _time.monotonic() < deadline:  # wait for a few committed steps
            if events.exists() and events.read_text().count('{"event":"step"') >= 3:
                break
            _time.sleep(0.2)
        else:
            raise AssertionError("no steps committed")
        os.kill(int((out / "logs" / "coordinator.pid").read_text()), _signal.SIGKILL)
        killed = _time.monotonic()
        stdout, stderr = p.communicate(timeout=60)
        took = _time.monotonic() - killed
    finally:
        if p.poll() is None:
            p.kill()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert p.returncode == 1, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: the coordinator was lost; last committed step: "), stderr
    last = int(lines[0].rsplit(" ", 1)[1])
    records = [_json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    recorded = max(r["step"] for r in records if r["event"] == "step")
    assert recorded - 1 <= last <= recorded and last < 399  # it ended mid-run, at the log's last step
    end = [r for r in records if r["event"] == "run_end"]
    assert len(end) == 1 and not end[0]["ok"] and "coordinator was lost" in end[0]["error"]
    summary = _json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["last_committed_step"] == recorded
    assert took < 20, took


@pytest.mark.timeout(30)
def test_a_generation_that_fails_after_the_coordinator_died_ends_as_a_lost_coordinator(tmp_path, monkeypatch):
    """The watch checks the coordinator at the top of a round, then reads a trainer's error that the
    coordinator's death caused in that same round: the generation is "lost" (one line naming the last
    committed step), not "failed" (CI at b228642: "failed", then the shutdown's store write raised into
    a traceback)."""
    from unbroken.config import Config
    from unbroken.events import EventLog
    from unbroken.runtime.launcher import generation as G

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "events.jsonl").write_text('{"event":"step","step":4}\n')
    watch = G.GenerationWatch(Config(), EventLog(tmp_path / "other.jsonl"), None, tmp_path, 0.0, None, None,
                               lambda: None, dead)
    monkeypatch.setattr(watch, "_loop", lambda *a: ("failed", "replica 0: the store went away"))
    assert watch.run(None, {}) == ("lost", "the coordinator was lost; last committed step: 4")
    monkeypatch.setattr(watch, "_loop", lambda *a: ("done", None))
    assert watch.run(None, {}) == ("done", None)
