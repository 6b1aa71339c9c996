"""`unbroken resume RUN_DIR` after the coordinator was SIGKILLed mid-run: the same run directory goes on
from the agents' in-memory snapshot and ends on the failure-free trajectory, bit for bit (--exact).

Real processes: the launcher, its coordinator (killed with a real SIGKILL), snapshot agents holding
/dev/shm slot files, trainers; the resumed run starts a new coordinator and new agents that adopt those
files. Bad input to `resume` (not a run, a finished run, an override of the trajectory): one line, exit 2.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import unbroken
from unbroken.events import read_events
from unbroken.observe.runs import audit, compare

SMALL = ["--replicas", "2", "--steps", "14", "--microbatches", "4", "--exact", "--run.progress=false",
         "--coord.heartbeat_timeout=5", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200",
         "--snapshot.enabled=true"]


def sealed(out) -> bool:
    """Whether the agents hold a snapshot step committed by every replica (its digest written): what a
    memory restore needs, read from the run's etcd store as the trainers would. (On etcd the agents
    poll for allocation requests every 0.25 s, so the first snapshot can lag the first steps.)"""
    from unbroken.runtime.store.client import connect
    from unbroken.runtime.snapshot.control import snapshot_keys
    run_id = next(e for e in read_events(out) if e["event"] == "run_start")["run_id"]
    k = snapshot_keys(run_id)
    store = connect((out / "coordinator.addr").read_text().strip(), timeout_s=5)
    if not store.check([k.held(0)]):
        return False
    held = json.loads(store.get(k.held(0)))
    both = set(held.get("0", [])) & set(held.get("1", []))
    return any(store.check([k.digest(s)]) for s in both)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_resume_after_the_coordinator_was_killed_continues_from_memory_on_the_trajectory(tmp_path, store, request):
    """tcp: the embedded store dies with its coordinator; etcd: the state outlives them, every coordinator
    (leader and standby) is killed, and the resumed run is a new generation in the same namespace."""
    ref, out = tmp_path / "reference", tmp_path / "run"
    steps = 14 if store == "tcp" else 40  # etcd: the first snapshot is sealed later (agents poll every 0.25 s)
    small = [*SMALL[:3], str(steps), *SMALL[4:]]
    r = unbroken("train", *small, "--out", str(ref))
    assert r.returncode == 0, r.stderr[-2000:]
    extra = [] if store == "tcp" else [f"--coord.store={request.getfixturevalue('etcd')}/resume-{uuid.uuid4().hex[:8]}",
                                       "--coord.standbys=1"]

    p = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "train", *small, *extra, "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = out / "events.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a few committed steps and a sealed snapshot, then the kill
            if events.exists() and events.read_text().count('{"event":"step"') >= 5 and (store == "tcp" or sealed(out)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("no steps committed")
        for pid in sorted((out / "logs").glob("coordinator*.pid")):  # etcd: the standby too
            os.kill(int(pid.read_text()), signal.SIGKILL)
        _, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1 and "the coordinator was lost" in stderr, stderr[-2000:]
    before = read_events(out)
    last = max(e["step"] for e in before if e["event"] == "step")
    assert last < steps - 1, "the kill came after the run had finished: nothing left to resume"
    snapped = {e["step"] for e in before if e["event"] == "snapshot"}

    r = unbroken("resume", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    # the kill happened: the first run ended with it, and its records are still in the log
    ends = [e for e in events if e["event"] == "run_end"]
    assert len(ends) == 2 and not ends[0]["ok"] and "coordinator was lost" in ends[0]["error"] and ends[1]["ok"]
    assert events[:len(before)] == before  # appended to, nothing rewritten
    resumed = [e for e in events if e["event"] == "restart" and e.get("resumed")]
    assert len(resumed) == 1 and resumed[0]["source"] == "memory"
    # both trainers restored the same step from memory: a snapshot taken before the kill, at most the last
    got = [e for e in events[len(before):] if e["event"] == "restored"]
    why = [e for e in events if e["event"] in ("restore_failed", "snapshot_skipped", "shard_rejected")]
    assert len(got) == 2 and {e["source"] for e in got} == {"memory"}, (got, why)
    n = got[0]["step"]
    assert {e["step"] for e in got} == {n} and n in snapped and 0 <= n <= last
    ref_digest = {e["step"]: e["param_digest"] for e in read_events(ref) if e["event"] == "step"}
    assert all(e["param_digest"] == ref_digest[n] for e in got)
    # the steps after N ran again, in the new generation, and every copy matches the failure-free run
    cmp = compare(ref, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == steps, [row for row in cmp.rows if not row[3]]
    assert audit(out, 4) == []
    c = unbroken("compare", str(ref), str(out))
    assert c.returncode == 0 and f"identical: {steps}/{steps} steps" in c.stdout, c.stdout[-1500:]

    # a finished run cannot be resumed: one line, exit 2, nothing written
    size = (out / "events.jsonl").stat().st_size
    r = unbroken("resume", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"unbroken: error: {str(out)!r} already finished: all {steps} steps committed"], r.stderr
    assert (out / "events.jsonl").stat().st_size == size


@pytest.mark.timeout(60)
def test_resume_refuses_what_is_not_a_resumable_run_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    r = unbroken("resume", str(tmp_path / "empty"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"unbroken: error: {str(tmp_path / 'empty')!r} is not a run directory (no events.jsonl and config.json)"]
    assert list((tmp_path / "empty").iterdir()) == []  # nothing written
    r = unbroken("resume", str(tmp_path / "empty"), "--run.steps=99")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "'--run.steps'" not in r.stderr
    assert "--run.steps: a resumed run keeps the settings it ran with" in r.stderr
    r = unbroken("resume", str(tmp_path / "empty"), "--replicas", "3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["unbroken: error: unrecognized argument "
                                                                    "'--replicas' (overrides look like "
                                                                    "--section.key=value)"], r.stderr
