"""Shared fixtures: runs through the product's own CLI and launcher, in real processes."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# A small run: 4 replicas, 8 microbatches, 12 steps, exact. Tests compare against one reference of it.
BASE = ["--replicas", "4", "--steps", "12", "--microbatches", "8", "--exact", "--run.progress=false",
        "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=240"]


def unbroken(*args: str, timeout: float = 240, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run the `unbroken` CLI as a user would, in a process of its own, and return what `subprocess.run`
    would. A run's ranks compute on the CPU unless the test names a device: the suite's groups are several
    gloo ranks a host, which on a GPU machine would share its one GPU under NCCL (refused); the `gpu`
    tests ask for CUDA.

    The process is forked from this worker's CLI server (`cli_server`), which imported the CLI, torch and
    the trainer once, and then calls `unbroken.cli.main(args)` as `python -m unbroken.cli` would: its own
    pid, environment, stdout, stderr and exit code (an uncaught exception: its traceback and 1). No module
    of ours reads the environment at import (test_architecture checks it), so what a fresh interpreter
    does differently is the ~2.5 CPU-s of imports it repeats in each run, and torch's own import-time
    reads (OMP_NUM_THREADS, TORCH_CPP_LOG_LEVEL), which the server takes as `unbroken train`'s launcher
    takes them. `fresh=True`, or UNBROKEN_TEST_FRESH=1 for the whole suite, execs a fresh interpreter instead."""
    if args and args[0] in ("train", "coordinator") and not any(a.startswith("--parallel.device") for a in args):
        args = (*args, "--parallel.device=cpu")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = None if fresh else cli_server()
    if server is None:
        return subprocess.run([sys.executable, "-m", "unbroken.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    with tempfile.TemporaryDirectory(prefix="unbroken-cli-") as d:
        out, err = f"{d}/stdout", f"{d}/stderr"
        child = server.spawn("unbroken.cli", list(args), env, log=out, err=err, mark=False)
        deadline = time.monotonic() + timeout
        while child.poll() is None:  # poll, not wait: wait holds the server's lock (side_by_side's threads)
            if time.monotonic() > deadline:
                child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(["unbroken", *args], timeout)
            time.sleep(0.05)
        return subprocess.CompletedProcess(["unbroken", *args], child.returncode,
                                           Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))


_cli: dict[str, object] = {}
_cli_lock = threading.Lock()


def cli_server():
    """This test worker's CLI fork server (`unbroken.runtime.launcher.zygote`), started on first use: a
    fresh interpreter that imports the CLI and what a run's processes import (as the launcher's own
    server does), with one OpenMP thread and torch's C++ log level as `unbroken.cli.main` sets it before
    torch is imported. None where it did not come up, or UNBROKEN_TEST_FRESH is set: each run then execs."""
    if os.environ.get("UNBROKEN_TEST_FRESH"):
        return None
    from unbroken.runtime.launcher.starting import COORDINATOR, DEFAULT_WORKER, FORKRUN, SNAPSHOT_AGENT
    from unbroken.runtime.launcher.zygote import Zygote
    with _cli_lock:
        if "server" not in _cli:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            # the CLI and its launcher, and every module the launcher's own fork server imports
            server = Zygote.start(["unbroken.cli", "unbroken.commands", "unbroken.runtime.launcher.launch",
                                   COORDINATOR, DEFAULT_WORKER[2], FORKRUN, SNAPSHOT_AGENT], env)
            _cli["server"] = server if server.usable() else None
        return _cli["server"]


def side_by_side(*runs: Callable[[], subprocess.CompletedProcess]) -> list[subprocess.CompletedProcess]:
    """Run independent CLI invocations at once, results in order. For bad-input checks: each is a fresh
    process that imports torch (~1.5 CPU-s) and some wait out a connect timeout, so one after another
    they took 14-19 s a test; side by side the waits overlap."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run(), runs))


# The files that take minutes on one test worker (each file's tests run on one: --dist loadfile), longest
# first by each file's summed test wall time in a full run (test_shrink's ~350 s down to ~20 s). They go
# first, and the many short files fill the run's end: in xdist's own order (most tests first) the two
# shrink files started ~11 minutes in and the run's last minute had one worker busy.
LONGEST_FIRST = ("tests/runtime/trainer/test_shrink.py", "tests/runtime/trainer/test_shrink_fsdp.py",
                 "tests/runtime/parallel/test_llama_groups.py", "tests/runtime/launcher/test_cluster.py",
                 "tests/cluster/test_hosts.py",
                 "tests/runtime/parallel/test_hf_groups.py", "tests/runtime/trainer/test_user_contract.py",
                 "tests/runtime/parallel/test_fsdp_composed.py",
                 "tests/runtime/parallel/test_pp_tp.py", "tests/runtime/trainer/test_groups.py",
                 "tests/runtime/parallel/test_precision.py", "tests/runtime/persist/test_restore_e2e.py",
                 "tests/runtime/trainer/test_recovery_e2e.py", "tests/test_oracle_schedule.py",
                 "tests/runtime/persist/test_pp_tp_persist.py", "tests/runtime/trainer/test_clipping_groups.py",
                 "tests/runtime/parallel/test_compile.py", "tests/runtime/persist/test_hf_causal_export.py",
                 "tests/runtime/trainer/test_eval_e2e.py", "tests/test_hf_example.py")


def pytest_collection_modifyitems(config, items):
    """Collection order is the order files go to workers (pyproject's addopts: --no-loadscope-reorder).
    A stable sort: each file's tests keep their order, so module fixtures are set up once."""
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The suite runs on 2 pytest-xdist workers (pyproject's addopts: multi-process tests spend much of
    their time waiting on timeouts and restarts, which the other worker's test fills). A test marked
    `alone` measures the host itself (the simulator's calibration needs a core per replica) and must not
    share it: it holds a lock file exclusively while every other test holds it shared. The lock spans the
    whole test, setup and teardown included: a module or session fixture (a reference run of 4-8
    processes) is set up inside the first test that asks for it, so a lock taken by a function fixture
    let the other worker's reference runs share the host with an `alone` test. Writers first: a test
    takes the gate before the lock, so an `alone` test waiting for the gate is not starved by the other
    worker's next tests. Without xdist (`-n 0`, one test at a time) nothing is locked."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    root = Path(tempfile.gettempdir()) / f"unbroken-host-{run}"  # one per pytest run, shared by its workers
    root.mkdir(exist_ok=True)
    alone = item.get_closest_marker("alone") is not None
    with open(root / "gate", "a") as gate, open(root / "lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The failure-free --exact run every fault test compares against."""
    out = tmp_path_factory.mktemp("reference")
    r = unbroken("train", *BASE, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """The URL of a 3-member etcd cluster on loopback: the one `.ci/run` started (UNBROKEN_TEST_ETCD), else
    one started here for the session. Skips only when no `etcd` binary is installed (`.ci/run` installs it)."""
    from tests.etcd_cluster import etcd_binary, start
    if os.environ.get("UNBROKEN_TEST_ETCD"):
        yield os.environ["UNBROKEN_TEST_ETCD"]
        return
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server; .ci/run installs it)")
    cluster = start(tmp_path_factory.mktemp("etcd"), 3)
    try:
        yield cluster.url
    finally:
        cluster.stop()
