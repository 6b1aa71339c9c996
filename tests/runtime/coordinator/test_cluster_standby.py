"""The cluster path with its state in etcd: two `unbroken coordinator` processes (a leader and a standby) on
one namespace of a real 3-member etcd, and one real `torchrun` job per replica group, run from docs/etcd.md's
own lines on 127.0.0.1. The leading coordinator is SIGKILLed mid-run: the standby leads within the lease
TTL, the torchrun workers never notice, and every step's digest is the failure-free run's in --exact.
Bad input to both commands with an etcd store is one line, exit 2, nothing written.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import side_by_side
from tests.runtime.launcher.test_cluster import doc_lines, env, local_reference, one_line_exit_2
from tests.runtime.coordinator.test_standby_e2e import TTL, leads, took_over
from unbroken.events import read_events, steps
from unbroken.observe.runs import audit, compare
from unbroken.runtime.store import keys
from unbroken.runtime.store.etcd import EtcdStore
from unbroken.runtime.launcher.processes import kill_tree

DOC_STORE = "etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379/cluster-42"
# long enough that steps commit after the takeover (about TTL + 0.3 s after the kill at step 3)
STEPS = 60


def etcd_lines(tmp: Path, etcd: str) -> list[list[str]]:
    """docs/etcd.md's etcd lines, on the fixture's cluster in a namespace of their own, the run directory
    under `tmp`, and the coordinators with STEPS steps and a lease of TTL s."""
    url = f"{etcd}/cluster-{uuid.uuid4().hex[:8]}"
    lines = [line.replace(DOC_STORE, url).replace("runs/cluster-etcd", str(tmp / "cluster")).split()
             for line in doc_lines("cluster-etcd-commands")]
    assert [a for a in lines[0] if a.startswith("--run.")] == [a for a in doc_lines()[0].split()
                                                             if a.startswith("--run.")]  # the TCP run's config
    return [line + [f"--run.steps={STEPS}", f"--coord.lease_ttl={TTL}"] if line[0] == "unbroken" else line
            for line in lines]


def until(what, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError("waited in vain")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_leading_coordinator_killed_under_torchrun_jobs_a_standby_leads_and_the_trajectory_holds(etcd,
                                                                                                       tmp_path):
    lines, out = etcd_lines(tmp_path, etcd), tmp_path / "cluster"
    procs = []

    def start(line: list[str], name: str) -> subprocess.Popen:
        procs.append(subprocess.Popen(line, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                      env=env(), cwd=tmp_path))
        return procs[-1]

    try:  # all at once, in any order, as on a cluster: the workers wait for the run to be set up
        coordinators = {start(line, f"coordinator{n}"): n for n, line in enumerate(lines[:2])}
        jobs = [start(line, f"group{n}") for n, line in enumerate(lines[2:])]
        until(lambda: leads(out) and sum(e["event"] == "step" for e in read_events(out)) >= 3)
        victim = leads(out)[-1]["pid"]
        (leader,) = [p for p in coordinators if p.pid == victim]
        (standby,) = [p for p in coordinators if p is not leader]
        log = tmp_path / f"coordinator{coordinators[standby]}.log"
        until(lambda: "torchrun" in log.read_text())  # the standby claimed the namespace and waits to lead
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        assert standby.wait(timeout=120) == 0, log.read_text()[-2000:]
        assert [j.wait(timeout=30) for j in jobs] == [0, 0]
    finally:
        for p in procs:
            kill_tree(p)
    assert leader.returncode == -signal.SIGKILL
    took = took_over(out, victim, killed_at)  # the standby leads within TTL + 2 s, over the running membership
    assert f"pid {victim} " in took["previous"]  # ... and says whom it replaced: the killed leader
    records = read_events(out)
    assert [e for e in records if e["event"] == "step" and e["t"] > took["t"]]  # steps committed under it
    assert not [e for e in records if e["event"] in ("member_dead", "restart")]  # no worker was blamed
    started = [e for e in records if e["event"] == "worker_start"]
    assert sorted(e["replica"] for e in started) == [0, 1] and all(e["torchrun"] for e in started)
    (end,) = [e for e in records if e["event"] == "run_end"]
    assert end["ok"] and end["t"] > took["t"]  # the run's end and summary written by the new leader
    assert (out / "summary.json").is_file()
    reference = local_reference(tmp_path, [f"--run.steps={STEPS}"])
    cmp = compare(reference, out)
    assert cmp.problems == [] and cmp.identical == cmp.total == STEPS
    assert audit(out, 4) == []
    assert steps(records)[STEPS - 1]["replicas"] == 2


@pytest.mark.timeout(120)
def test_bad_etcd_input_to_the_coordinator_and_the_worker_is_one_line_and_writes_nothing(etcd, tmp_path):
    cli = [sys.executable, "-m", "unbroken.cli", "coordinator"]
    worker = [sys.executable, "-m", "unbroken.runtime.trainer", "--group", "0", "--coordinator"]
    out = tmp_path / "never"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=60,
                              env={**env(), "UNBROKEN_CONNECT_TIMEOUT": "2"})

    other = f"{etcd}/other-{uuid.uuid4().hex[:8]}"
    EtcdStore(other).set(keys.run_id(), "run-someone")  # a `unbroken train` run's namespace
    claimed = f"{etcd}/claimed-{uuid.uuid4().hex[:8]}"
    store = EtcdStore(claimed)
    store.set(keys.config(), "{}")  # a coordinator of another config has the namespace
    store.set(keys.run_id(), "run-other")
    cases = [  # (argv, the one line it must print)
        ([*cli, "--out", str(out), "--coord.store=etcd://127.0.0.1:9/x"],
         r"^unbroken: error: coord.store='etcd://127.0.0.1:9/x': no etcd member answers$"),
        ([*cli, "--out", str(out), f"--coord.store={other}"],
         r"holds 1 keys of run 'run-someone'; use another namespace .*etcdctl del --prefix"),
        ([*cli, "--out", str(out), f"--coord.store={claimed}"], r"holds 2 keys of run 'run-other' \(another config\)"),
        ([*cli, "--out", str(out), "--port", "29400", f"--coord.store={etcd}/x"],
         r"^unbroken: error: --port: with coord.store=.* the coordinator binds nothing"),
        ([*worker, "etcd://127.0.0.1:9/x"],
         r"^unbroken: error: --coordinator 'etcd://127.0.0.1:9/x': no etcd member answers$"),
        ([*worker, "etcd://h:1:2/x"], r"--coordinator 'etcd://h:1:2/x': bad member 'h:1:2'"),
        ([*worker, f"{etcd}/empty-{uuid.uuid4().hex[:8]}"], r"serves no unbroken run"),
    ]
    for (_, pattern), r in zip(cases, side_by_side(*(lambda argv=argv: run(*argv) for argv, _ in cases))):
        one_line_exit_2(r, pattern)
    assert store.num_keys() == 2 and EtcdStore(other).num_keys() == 1  # nothing written into etcd
    assert not out.exists()  # nor into the run directory
