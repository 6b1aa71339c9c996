"""Real trainer processes, real SIGKILLs: a copy torn mid-way leaves the previous snapshot whole,
and the agent outlives every trainer so new processes restore the last commit bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import same, state
from unbroken.runtime.snapshot.client import SnapshotClient
from unbroken.runtime.snapshot.control import Topology, snapshot_keys
from unbroken.runtime.snapshot.shm import SlotFile, State, data_path

# 5 s alone; in CI at 87d01b2, beside a many-process test on the other worker, the agents' start and the
# saves took ~48 s and the restore was 12 s into its 40 s wait when a 60 s limit ended it. The limit is a
# backstop above the test's own waits (the restorers' 40 s each, their store's 30 s, gloo's 20 s)
pytestmark = pytest.mark.timeout(150)
HERE = Path(__file__).parent


def trainer(mode: str, agents, rank: int, world: int, **kw) -> subprocess.Popen:
    args = [sys.executable, str(HERE / "trainer_proc.py"), mode, "--port", str(agents.store.port),
            "--run", agents.run_id, "--shm", agents.shm(rank // agents.topo.ranks_per_node),
            "--rank", str(rank), "--world", str(world)]
    args += [f"--{k}={v}" for k, v in kw.items()]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def test_writer_killed_mid_copy_keeps_previous_snapshot(agents_factory):
    agents = agents_factory(Topology(1, 1, "none"))
    n = 48_000_000  # ~290 MB: the copy takes tens of ms, far longer than reading a line and killing
    p = trainer("kill-mid-copy", agents, 0, 1, n=n)
    assert p.stdout.readline().strip() == "COPYING"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    slots = [SlotFile.open(data_path(agents.shm(0), agents.run_id, 0, b)) for b in (0, 1)]
    by_step = {s.get("step"): s.get("state") for s in slots}
    assert by_step == {1: State.COMMITTED, 2: State.WRITING}  # torn copy of step 2, never committed
    for s in slots:
        s.close()
    c = SnapshotClient(agents.store, run_id=agents.run_id, rank=0, world=1, shm_dir=agents.shm(0))
    got = c.restore()
    assert got.step == 1 and got.meta == {"step": 1} and same(got.tensors, state(1, n))


def test_agents_outlive_killed_trainers_and_new_processes_restore(agents_factory):
    agents = agents_factory(Topology(2, 1, "none"))
    ps = [trainer("save", agents, r, 2, steps=3) for r in range(2)]
    for p in ps:
        assert p.stdout.readline().strip() == "SAVED 3"
    for p in ps:  # every trainer dies at once
        os.kill(p.pid, signal.SIGKILL)
    for p in ps:
        p.wait()
    assert all(a.poll() is None for a in agents.procs.values())  # the agents are still serving
    new = [trainer("restore", agents, r, 2, steps=3) for r in range(2)]
    outs = [p.communicate(timeout=40)[0].strip() for p in new]
    assert outs == ["RESTORED 3 OK", "RESTORED 3 OK"], agents.logs()
    assert [p.returncode for p in new] == [0, 0]


def test_a_skipped_save_keeps_a_step_every_rank_holds(agents_factory):
    """Rank 0's agent falls two copies behind (SIGSTOPped: a real stalled process), so rank 0 skips its
    save of step 4 while rank 1 saves it, and marks step 4 incomplete in its own family and its sibling's. At step 5 rank 1 must overwrite step 4 (never held by all)
    and keep step 3, so the agents still hold two steps in common; overwriting step 3, the older, left
    only step 5, and a resume limited to the log's step 4 found nothing to load (CI, etcd resume)."""
    agents = agents_factory(Topology(2, 1, "none"))
    sibling = f"{agents.run_id}.s1"  # another shard index's family, as a replica group's rank 1 has
    c = [SnapshotClient(agents.store, run_id=agents.run_id, rank=r, world=2, shm_dir=agents.shm(r),
                        siblings=(sibling,)) for r in range(2)]
    for r in range(2):
        c[r].save(1, state(1), {"step": 1})
        c[r].wait_committed(1)
    os.kill(agents.procs[0].pid, signal.SIGSTOP)
    try:
        saved = []
        for s in (2, 3, 4):
            saved.append(c[0].save_async(s, state(s), {"step": s}, skip_if_busy=True))
            c[0].wait()
    finally:
        os.kill(agents.procs[0].pid, signal.SIGCONT)
    assert saved == [True, True, False]  # 2 and 3 copied (not committed), 4 skipped
    assert agents.store.check([c[0].keys.incomplete(4)])
    # and in the sibling family's keys: its ranks then keep step 3 too, one step common to every shard index
    assert agents.store.check([snapshot_keys(sibling).incomplete(4)])
    assert not agents.store.check([snapshot_keys(sibling).incomplete(3)])
    for s in (2, 3, 4):
        c[1].save(s, state(s), {"step": s})
        c[1].wait_committed(s)
    c[0].wait_committed(3)
    for r in range(2):
        c[r].save(5, state(5), {"step": 5})
        c[r].wait_committed(5)
    held = {r: sorted(s.get("step") for s in (SlotFile.open(data_path(agents.shm(r), agents.run_id, r, b))
                                                for b in (0, 1))) for r in range(2)}
    assert held == {0: [3, 5], 1: [3, 5]}, held
    assert c[1].committed_steps() == [3, 5]


def test_a_replaced_agent_seals_a_step_whose_count_its_predecessor_never_made(agents_factory):
    """The agent is SIGKILLed after writing the last commit record of step 1 but before counting it
    (rebuilt here by removing the digest and the count's effect from the store; the launcher kills
    agents first when the coordinator is lost, so a kill can land there). The agent started in its
    place adopts the slots and must seal step 1 from the records alone, or a resume finds no sealed
    step and starts over (CI: `ncommit/5` at 1, both records written)."""
    agents = agents_factory(Topology(1, 2, "none"))
    c = [SnapshotClient(agents.store, run_id=agents.run_id, rank=r, world=2, shm_dir=agents.shm(0))
         for r in range(2)]
    for r in range(2):
        c[r].save(1, state(1), {"step": 1})
    for r in range(2):
        c[r].wait_committed(1)
    digest = agents.store.get(c[0].keys.digest(1))
    agents.procs[0].kill()
    agents.procs.pop(0).wait()
    agents.store.delete_key(c[0].keys.digest(1))  # ... as if the kill came before the count sealed it
    assert c[0].committed_steps() == []
    agents.start(0)  # adopts the slot files of the killed one
    assert agents.store.get(c[0].keys.digest(1)) == digest
    assert c[0].committed_steps() == [1]
