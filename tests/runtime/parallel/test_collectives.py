"""EpochGroup with real processes on gloo: a member that stops (SIGSTOP) or dies (SIGKILL) while the others
are inside an all-reduce never hangs them for the group's timeout. Once a new epoch is published in the
store (the key layout of runtime/store/keys.py, written here by the test as the coordinator would),
the survivors leave within 2 s of a 30 s timeout, with EpochMoved (or CollectiveError for a dead peer),
their own buffers untouched, and then reduce correctly as the two-member group of epoch 1."""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).parents[3]
VICTIM, TIMEOUT_S, N = 2, 30.0, 100_000

# One member: reduce once in epoch 0 with all three; the victim then parks (never issues again) while the
# survivors issue a second all-reduce and block; the test stops or kills the victim and moves the epoch.
MEMBER = """
import json, os, sys, time
import torch
from unbroken.runtime.parallel.collectives import CollectiveError, EpochGroup, EpochMoved
from unbroken.runtime.store.client import connect

address, me, N, TIMEOUT_S = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
group_store, watch = connect(address), connect(address)  # one client per thread: formation runs in its own
epoch = lambda: int(watch.get("epoch"))
members = lambda e: tuple(json.loads(watch.get(f"members/{e}")))
buf = torch.arange(N, dtype=torch.float64) * (me + 1)
keep = buf.clone()
g0 = EpochGroup(group_store, 0, members(0), me, TIMEOUT_S)
first = g0.allreduce(buf, lambda: epoch() > 0).tensor
watch.set(f"round1/{me}", json.dumps(torch.equal(first, torch.arange(N, dtype=torch.float64) * 6)))
if me == %d:
    time.sleep(600)  # parked: stopped or killed by the test, never issues the second all-reduce
try:
    g0.allreduce(buf, lambda: epoch() > 0, on_issued=lambda: watch.set(f"issued/{me}", "1"))
    outcome = "completed"
except EpochMoved:
    outcome = "EpochMoved"
except CollectiveError:
    outcome = "CollectiveError"
watch.set(f"outcome/{me}", json.dumps({"outcome": outcome, "t": time.time(), "intact": torch.equal(buf, keep)}))
while epoch() < 1:
    time.sleep(0.005)
g1 = EpochGroup(group_store, 1, members(1), me, TIMEOUT_S)
second = g1.allreduce(buf, lambda: epoch() > 1).tensor
want = torch.arange(N, dtype=torch.float64) * sum(m + 1 for m in members(1))
watch.set(f"result/{me}", json.dumps({"ok": torch.equal(second, want), "intact": torch.equal(buf, keep)}))
sys.stdout.flush()
os._exit(0)  # skip destructors of the abandoned epoch-0 group
""" % VICTIM


@pytest.fixture
def cluster():
    """A store master in the test process and three member processes; every one SIGKILLed afterwards."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60), use_libuv=True)
    store.set("members/0", json.dumps([0, 1, 2]))
    store.set("epoch", "0")
    procs = [subprocess.Popen([sys.executable, "-c", MEMBER, f"127.0.0.1:{store.port}", str(r), str(N),
                               str(TIMEOUT_S)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(3)]
    try:
        yield store, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait(timeout=10)


def wait_keys(store: TCPStore, keys: list[str], procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for p in procs:
            if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL):  # 0: done first
                pytest.fail(f"member exited with {p.returncode}: {p.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {keys}"
        time.sleep(0.01)


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def move_epoch(store: TCPStore) -> float:
    """Publish epoch 1 without the victim, members first, as coordinator.py does."""
    store.set("members/1", json.dumps([0, 1]))
    t = time.time()
    store.set("epoch", "1")
    return t


def fail_and_recover(cluster, sig: int) -> tuple[dict, float, float]:
    store, procs = cluster
    survivors = [r for r in range(3) if r != VICTIM]
    wait_keys(store, [f"round1/{r}" for r in range(3)], procs, 90)  # epoch 0 formed and reduced by all three
    assert all(json.loads(store.get(f"round1/{r}")) for r in range(3))
    wait_keys(store, [f"issued/{r}" for r in survivors], procs, 20)
    time.sleep(0.3)
    assert not store.check([f"outcome/{r}" for r in survivors[:1]]), "survivors should be blocked in gloo"
    victim = procs[VICTIM]
    t_fault = time.time()
    os.kill(victim.pid, sig)
    if sig == signal.SIGSTOP:
        while state(victim.pid) != "T":
            time.sleep(0.005)
        time.sleep(0.5)  # a hung peer: nothing comes back, nothing closes; survivors must still be waiting
        assert not any(store.check([f"outcome/{r}"]) for r in survivors)
    else:
        victim.wait(timeout=10)
    t_moved = move_epoch(store)
    wait_keys(store, [f"outcome/{r}" for r in survivors], procs, 10)
    outcomes = {r: json.loads(store.get(f"outcome/{r}")) for r in survivors}
    wait_keys(store, [f"result/{r}" for r in survivors], procs, 30)
    for r in survivors:
        assert outcomes[r]["intact"], f"replica {r}'s own buffer changed: {outcomes[r]}"
        result = json.loads(store.get(f"result/{r}"))
        assert result == {"ok": True, "intact": True}, (r, result)
        assert procs[r].wait(timeout=20) == 0
    return outcomes, t_fault, t_moved


def test_stopped_member_frees_survivors_when_the_epoch_moves(cluster):
    outcomes, _, t_moved = fail_and_recover(cluster, signal.SIGSTOP)
    for r, o in outcomes.items():
        assert o["outcome"] == "EpochMoved", outcomes
        assert 0 <= o["t"] - t_moved < 2.0, f"replica {r} left {o['t'] - t_moved:.2f} s after the epoch moved"
    assert cluster[1][VICTIM].poll() is None and state(cluster[1][VICTIM].pid) == "T"  # still hung


def test_killed_member_gives_a_quick_typed_failure(cluster):
    outcomes, t_fault, _ = fail_and_recover(cluster, signal.SIGKILL)
    for r, o in outcomes.items():
        assert o["outcome"] in ("CollectiveError", "EpochMoved"), outcomes
        assert o["t"] - t_fault < 2.0, f"replica {r} left {o['t'] - t_fault:.2f} s after the kill ({outcomes})"
