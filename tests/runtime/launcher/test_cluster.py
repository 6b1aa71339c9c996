"""The cluster path: `unbroken coordinator` plus one real `torchrun` job per replica group (group 1's run
as forkrun: torchrun with its ranks forked), run from docs/cluster.md's own lines on 127.0.0.1; a rank
SIGKILLed under torchrun; bad input to both commands."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docblocks import marked_lines
from unbroken.events import read_events, steps

BIN = Path(sys.executable).parent  # unbroken and torchrun of this environment, as with the venv active


# the page that holds each block of command lines the cluster tests run as written
PAGES = {"cluster-commands": "docs/cluster.md", "cluster-etcd-commands": "docs/etcd.md"}


def doc_lines(block: str = "cluster-commands") -> list[str]:
    """The command lines of the docs' block between `<!-- block -->` and `<!-- /block -->`."""
    return marked_lines(PAGES[block], block)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


def run_cluster(tmp: Path, extra: list[str] = (), timeout: float = 150) -> tuple[subprocess.CompletedProcess,
                                                                                   list[subprocess.Popen]]:
    """docs/cluster.md's lines, with a free port and a run directory under `tmp`, plus `extra` coordinator
    flags. Returns the coordinator's completed process and the torchrun jobs (ended)."""
    port = str(free_port())
    lines = [line.replace("29400", port).replace("runs/cluster", str(tmp / "cluster")).split()
             for line in doc_lines()]
    coordinator = subprocess.Popen(lines[0] + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env(), cwd=tmp)
    first = coordinator.stdout.readline()
    assert first.startswith("unbroken coordinator: serving 127.0.0.1:" + port), first
    jobs = [subprocess.Popen(line, stdout=open(tmp / f"group{n}.log", "w"), stderr=subprocess.STDOUT, env=env(),
                             cwd=tmp) for n, line in enumerate(lines[1:])]
    try:
        out = "".join(iter(coordinator.stdout.readline, ""))  # to its end: the coordinator ends with the run
        coordinator.wait(timeout=timeout)
        for j in jobs:
            j.wait(timeout=30)
    finally:
        for p in [coordinator, *jobs]:
            if p.poll() is None:
                p.kill()
    return subprocess.CompletedProcess(lines[0], coordinator.returncode, first + out, ""), jobs


def local_reference(tmp: Path, extra: list[str] = ()) -> Path:
    """The same run through the local launcher (`unbroken train`): the documented coordinator's `--run.` flags,
    then `extra` overrides."""
    flags = [a for a in doc_lines()[0].split() if a.startswith("--run.")] + list(extra)
    out = tmp / "local"
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *flags, "--run.progress=false", "--out",
                        str(out)], capture_output=True, text=True, timeout=150, env=env())
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_documented_cluster_commands_match_the_local_launcher_bitwise(tmp_path):
    r, jobs = run_cluster(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "torchrun --standalone --nproc-per-node=1" in r.stdout  # it prints the lines to run
    assert [j.returncode for j in jobs] == [0, 0]
    started = [e for e in read_events(tmp_path / "cluster") if e["event"] == "worker_start"]
    assert sorted(e["replica"] for e in started) == [0, 1] and all(e["torchrun"] for e in started)
    assert {e["replica"]: e["forked"] for e in started} == {0: "", 1: "agent"}  # torchrun's, forkrun's
    cluster, local = steps(read_events(tmp_path / "cluster")), steps(read_events(local_reference(tmp_path)))
    assert sorted(cluster) == sorted(local) == list(range(6))
    assert [cluster[s]["param_digest"] for s in range(6)] == [local[s]["param_digest"] for s in range(6)]
    assert (tmp_path / "cluster" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_under_torchrun_leaves_the_survivor_on_the_trajectory(tmp_path):
    local = steps(read_events(local_reference(tmp_path)))
    faults = "--run.faults=kill:replica=1,step=2,phase=allreduce"
    r, jobs = run_cluster(tmp_path, [faults, "--coord.heartbeat_timeout=3"])
    assert r.returncode == 0, r.stdout[-3000:]
    records = read_events(tmp_path / "cluster")
    fired = [e for e in records if e["event"] == "fault"]
    assert [(e["kind"], e["replica"], e["step"], e["phase"]) for e in fired] == [("kill", 1, 2, "allreduce")]
    dead = [e for e in records if e["event"] == "member_dead"]
    assert [e["replica"] for e in dead] == [1]  # found by the coordinator alone: no launcher reports exits
    assert jobs[1].returncode != 0 and jobs[0].returncode == 0  # forkrun's torchrun saw its rank die
    cluster = steps(records)
    assert cluster[2]["replicas"] == 1 and cluster[1]["replicas"] == 2  # the kill took effect in step 2
    assert (cluster[1]["ranks"], cluster[2]["ranks"]) == (2, 1)
    assert [cluster[s]["param_digest"] for s in range(6)] == [local[s]["param_digest"] for s in range(6)]


def one_line_exit_2(r: subprocess.CompletedProcess, pattern: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and re.search(pattern, lines[0]), r.stderr


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "unbroken.cli", "coordinator", "--out", str(tmp_path / "x"),
                            "--port", str(port)], capture_output=True, text=True, timeout=50)
    one_line_exit_2(r, rf"unbroken: error: cannot listen on 127\.0\.0\.1:{port}: .*in use")
    assert not (tmp_path / "x" / "config.json").exists()  # nothing written


@pytest.mark.timeout(60)
def test_a_coordinator_that_does_not_answer_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "unbroken.runtime.trainer", "--coordinator", f"127.0.0.1:{port}",
                        "--group", "0"], capture_output=True, text=True, timeout=50,
                       env={**os.environ, "UNBROKEN_CONNECT_TIMEOUT": "2"})
    one_line_exit_2(r, rf"unbroken: error: the coordinator at '127\.0\.0\.1:{port}' does not answer")
    assert time.monotonic() - t < 40


@pytest.mark.timeout(60)
def test_a_group_outside_the_run_is_one_line(tmp_path):
    port = str(free_port())
    coordinator = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "coordinator", "--out", str(tmp_path),
                                    "--port", port, "--run.replicas=2", "--coord.startup_timeout=30"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert coordinator.stdout.readline().startswith("unbroken coordinator: serving")
        r = subprocess.run([sys.executable, "-m", "unbroken.runtime.trainer", "--coordinator", f"127.0.0.1:{port}",
                            "--group", "5"], capture_output=True, text=True, timeout=50)
        one_line_exit_2(r, r"unbroken: error: group 5 out of range: 2 groups")
        r = subprocess.run([sys.executable, "-m", "unbroken.cli", "worker", "--coordinator", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=50)
        one_line_exit_2(r, r"unbroken: error: .*--group")
    finally:
        coordinator.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_local_launcher_runs_torchrun_per_group(tmp_path):
    """`--run.launcher=torchrun`: the local launcher starts the cluster's command; a kill inside it is seen
    (the agent exits), the survivor redoes the work, and the trajectory is the direct launcher's."""
    local = steps(read_events(local_reference(tmp_path)))
    flags = [a for a in doc_lines()[0].split() if a.startswith("--run.")]
    out = tmp_path / "torchrun"
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *flags, "--run.progress=false",
                        "--run.launcher=torchrun", "--run.faults=kill:replica=0,step=3,phase=compute",
                        "--out", str(out)], capture_output=True, text=True, timeout=200, env=env())
    assert r.returncode == 0, r.stderr[-2000:]
    records = read_events(out)
    assert [(e["kind"], e["replica"], e["step"]) for e in records if e["event"] == "fault"] == [("kill", 0, 3)]
    assert [e["replica"] for e in records if e["event"] == "member_dead"] == [0]
    started = [e for e in records if e["event"] == "worker_start"]
    assert sorted(e["replica"] for e in started) == [0, 1] and all(e["torchrun"] for e in started)
    ran = steps(records)
    assert ran[3]["replicas"] == 1
    assert [ran[s]["param_digest"] for s in range(6)] == [local[s]["param_digest"] for s in range(6)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_group_lost_ends_the_coordinator_with_the_last_committed_step(tmp_path):
    faults = "--run.faults=kill:replica=0,step=2,phase=allreduce; kill:replica=1,step=2,phase=allreduce"
    r, jobs = run_cluster(tmp_path, [faults, "--coord.heartbeat_timeout=2"])
    records = read_events(tmp_path / "cluster")
    assert sorted(e["replica"] for e in records if e["event"] == "fault") == [0, 1]
    assert r.returncode == 1, r.stdout[-2000:]
    (last,) = [e["last_committed_step"] for e in records if e["event"] == "run_failed"]
    # the step both died in never commits; the one before may have committed with its record unwritten
    # (its writer died beside the next step's compute): the store's decision still counts it
    assert max(steps(records)) <= last < 2
    assert f"unbroken: error: every replica group was lost; last committed step: {last}" in r.stdout
    assert all(j.returncode != 0 for j in jobs)
