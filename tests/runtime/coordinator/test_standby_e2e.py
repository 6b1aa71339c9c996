"""A standby coordinator takes over: runs on a real 3-member etcd cluster, the leading coordinator
SIGKILLed mid-run (alone, and in the same step as a replica), in --exact, against the failure-free run.

The coordinators elect a leader by an etcd lease (election.py); the standby leads once the killed
leader's lease lapses (coord.lease_ttl), rebuilds the membership from the store, and the run ends with
every step's digest equal to the failure-free run's. Everything asserted comes from events.jsonl.
"""
from __future__ import annotations

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

TTL = 2
SMALL = ["--replicas", "2", "--steps", "60", "--microbatches", "4", "--exact", "--run.progress=false",
         "--coord.heartbeat_timeout=5", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("standby") / "ref"
    r = unbroken("train", *SMALL, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def leads(out) -> list[dict]:
    path = out / "events.jsonl"
    return [e for e in read_events(out) if e["event"] == "coordinator_leads"] if path.exists() else []


def run_and_kill_the_leader(out, etcd, when, faults: str = "") -> tuple[int, float]:
    """Start a run with one standby; once `when(records)` holds, SIGKILL the leading coordinator. Returns
    (the killed pid, when) after the run ended with exit 0."""
    p = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "train", *SMALL, "--faults", faults,
                          f"--coord.store={etcd}/standby-{uuid.uuid4().hex[:8]}", f"--coord.lease_ttl={TTL}",
                          "--coord.standbys=1", "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "events.jsonl").exists() and leads(out) and when(read_events(out)):
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the moment to kill never came")
        victim = leads(out)[-1]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-2000:]
        return victim, killed_at
    finally:
        if p.poll() is None:
            p.kill()


def took_over(out, victim: int, killed_at: float) -> dict:
    """The standby's leadership record: after the kill, within the TTL (plus scheduling slack on 2 cores)."""
    after = [e for e in leads(out) if e["t"] > killed_at]
    assert len(after) == 1 and after[0]["pid"] != victim and after[0]["takeover"], leads(out)
    assert after[0]["t"] - killed_at <= TTL + 2.0, after[0]["t"] - killed_at
    return after[0]


@pytest.mark.timeout(200)
def test_the_leader_killed_mid_run_a_standby_leads_within_the_ttl_and_the_trajectory_holds(etcd, reference,
                                                                                           tmp_path):
    out = tmp_path / "run"
    victim, killed_at = run_and_kill_the_leader(
        out, etcd, lambda rs: sum(r["event"] == "step" for r in rs) >= 3)
    took_over(out, victim, killed_at)
    records = read_events(out)
    assert [e for e in records if e["event"] == "step" and e["t"] > killed_at]  # steps committed after it
    assert not [e for e in records if e["event"] in ("member_dead", "restart")]  # nobody was blamed
    cmp = compare(reference, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == 60
    assert audit(out, 4) == []


@pytest.mark.timeout(200)
def test_the_leader_killed_in_the_same_step_as_a_replica_both_recoveries_hold(etcd, reference, tmp_path):
    out = tmp_path / "run"
    victim, killed_at = run_and_kill_the_leader(
        out, etcd, lambda rs: any(r["event"] == "fault" for r in rs), faults="kill:replica=1,step=6,phase=allreduce")
    took_over(out, victim, killed_at)
    records = read_events(out)
    fault = next(e for e in records if e["event"] == "fault")
    assert fault["replica"] == 1 and fault["step"] == 6
    dead = [e for e in records if e["event"] == "member_dead"]
    assert [e["replica"] for e in dead] == [1]  # the replica's loss was still seen, by the new leader
    step6 = [e for e in records if e["event"] == "step" and e["step"] == 6]
    assert len(step6) == 1 and step6[0]["members"] == [0]  # step 6 committed by the survivor, in-step
    cmp = compare(reference, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == 60
    assert audit(out, 4) == []
