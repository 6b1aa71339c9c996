"""Runs whose coordination state lives in a real etcd cluster (3 members on loopback), through `unbroken
train --coord.store=etcd://...`, against the failure-free run on the embedded TCPStore, in --exact.

An etcd member SIGKILLed mid-run (the cluster's leader: the worst one to lose) must not stop the run;
bad store input (a URL nobody answers at, a namespace holding another run's keys) is one line, exit 2,
and nothing written.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import side_by_side, unbroken
from unbroken.events import read_events
from unbroken.observe.runs import audit, compare
from unbroken.runtime.store import keys
from unbroken.runtime.store.etcd import EtcdStore
from unbroken.runtime.store.client import read

SMALL = ["--replicas", "2", "--steps", "10", "--microbatches", "4", "--exact", "--run.progress=false",
         "--coord.heartbeat_timeout=5", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200"]


@pytest.fixture(scope="module")
def tcp_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("tcp") / "ref"
    r = unbroken("train", *SMALL, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.timeout(120)
def test_a_run_on_etcd_follows_the_failure_free_trajectory(etcd, tcp_reference, tmp_path):
    url = f"{etcd}/run-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    r = unbroken("train", *SMALL, f"--coord.store={url}", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    cmp = compare(tcp_reference, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == 10
    assert audit(out, 4) == []
    # the run's state is in etcd: its id, its step records' last commit
    run_id = next(e for e in read_events(out) if e["event"] == "run_start")["run_id"]
    store = EtcdStore(url)
    assert read(store, keys.run_id()) == run_id.encode()
    assert (out / "coordinator.addr").read_text().strip() == url
    st = unbroken("status", url)  # an operator's view, read from etcd
    assert st.returncode == 0 and run_id in st.stdout and "step 10/10" in st.stdout, st.stdout + st.stderr


def leader(cluster) -> int:
    """The index of the member that leads the cluster now."""
    s = EtcdStore(cluster.url)
    for i, st in enumerate(s.status()):
        if "error" not in st and st["leader"] == st["header"]["member_id"]:
            return i
    raise AssertionError(f"no leader: {s.status()}")


@pytest.mark.timeout(150)
def test_one_etcd_member_killed_mid_run_the_run_goes_on(tcp_reference, tmp_path):
    from tests.etcd_cluster import etcd_binary, start
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server; .ci/run installs it)")
    cluster = start(tmp_path / "etcd", 3)
    out = tmp_path / "run"
    try:
        p = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "train", *SMALL,
                              f"--coord.store={cluster.url}/member-kill", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        events = out / "events.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (events.exists() and events.read_text().count('"event":"step"') >= 3):
            time.sleep(0.05)
        victim = leader(cluster)
        killed_at = time.time()
        cluster.kill(victim)
        assert cluster.procs[victim].poll() is not None  # the member is gone
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    finally:
        cluster.stop()
    records = read_events(out)
    before = [e["step"] for e in records if e["event"] == "step" and e["t"] < killed_at]
    after = [e["step"] for e in records if e["event"] == "step" and e["t"] > killed_at]
    assert before and after and max(before) < 9, (before, after)  # killed mid-run; steps committed after it
    assert not [e for e in records if e["event"] in ("member_dead", "restart")]  # nobody lost, no restart
    cmp = compare(tcp_reference, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == 10


@pytest.mark.timeout(60)
def test_bad_store_input_is_one_line_and_writes_nothing(etcd, tmp_path):
    out = tmp_path / "never"
    url = f"{etcd}/other-{uuid.uuid4().hex[:8]}"
    EtcdStore(url).set(keys.run_id(), "run-someone")
    r, st, taken, bad = side_by_side(
        lambda: unbroken("train", *SMALL, "--coord.store=etcd://127.0.0.1:9/x", "--out", str(out)),
        lambda: unbroken("status", "etcd://127.0.0.1:9/x"),
        lambda: unbroken("train", *SMALL, f"--coord.store={url}", "--out", str(out)),
        lambda: unbroken("train", *SMALL, "--coord.store=etcd://h1:2379:9", "--out", str(out)))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "unbroken: error: coord.store='etcd://127.0.0.1:9/x': no etcd member answers"], r.stderr
    assert st.returncode == 2 and len(st.stderr.strip().splitlines()) == 1 and "no etcd member answers" in st.stderr
    assert taken.returncode == 2 and len(taken.stderr.strip().splitlines()) == 1, taken.stderr
    assert "holds 1 keys of run 'run-someone'" in taken.stderr and "etcdctl del --prefix" in taken.stderr
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "unbroken: error: coord.store='etcd://h1:2379:9': bad member 'h1:2379:9' (host:port)"], bad.stderr
    assert not out.exists()
    assert EtcdStore(url).num_keys() == 1  # nothing written into the namespace it refused


@pytest.mark.timeout(150)
def test_the_whole_etcd_cluster_lost_ends_the_run_with_one_line_and_a_summary(tmp_path):
    from tests.etcd_cluster import etcd_binary, start
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server; .ci/run installs it)")
    cluster = start(tmp_path / "etcd", 3)
    out = tmp_path / "run"
    try:
        p = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "train", *SMALL[:3], "400", *SMALL[4:],
                              f"--coord.store={cluster.url}/all-lost?failover=3", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        events = out / "events.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (events.exists() and events.read_text().count('"event":"step"') >= 3):
            time.sleep(0.05)
        for m in range(3):
            cluster.kill(m)
        _, err = p.communicate(timeout=120)
    finally:
        cluster.stop()
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("unbroken: error: the store was lost (no etcd member answers); last committed step: ")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and 2 <= summary["last_committed_step"] < 399
