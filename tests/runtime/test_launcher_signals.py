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

pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def processes_naming(text: str) -> list[int]:
    """Pids whose command line contains `text` (the coordinator names the run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " "):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_sigterm_to_the_launcher_stops_every_child_and_exits_non_zero(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", "2", "--steps", "400",
           "--microbatches", "2", "--run.progress=false", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not any(
            e["event"] == "step" for e in (read_events(out) if (out / "events.jsonl").exists() else [])):
        time.sleep(0.1)
    children = [int((out / "logs" / f"replica{r}.pid").read_text()) for r in range(2)]
    children += [p for p in processes_naming(f"--run-dir {out}") if p != proc.pid]
    assert len(children) == 3 and all(alive(p) for p in children), children

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == "unbroken: error: interrupted"
    gone_by = time.time() + 10
    while time.time() < gone_by and any(alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "children outlived the launcher"
    assert (out / "summary.json").exists()  # ended, not cut off: the summary is written
