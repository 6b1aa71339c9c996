"""Real trainer processes, real SIGKILLs: a copy torn mid-way leaves the previous snapshot whole,
and the agent outlives every trainer so new processes restore the last commit bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from snapstates import same, state
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


def test_a_skipped_save_keeps_a_step_every_family_sealed(agents_factory):
    """Two shard indices' families (a replica group's ranks 0 and 1), two ranks each. Family 0's agent of
    node 0 falls behind (SIGSTOPped: a real stalled process): its rank 0 copies step 2 but skips step 3
    (both slots busy), marking 3 incomplete in both families. Every other rank skips step 3 too: its step 2
    is not sealed in family 0 (rank 0's copy of it is not committed), so the older step 1, sealed in every
    family, is not overwritten (the two-phase seal). Once the agent is back, step 2 is sealed everywhere and
    step 4 overwrites step 1: every rank of both families holds steps 2 and 4, sealed in both."""
    agents = agents_factory(Topology(2, 1, "none"))
    sibling = agents_factory(Topology(2, 1, "none"), run_id=f"{agents.run_id}.s1")
    fams = [(agents, sibling.run_id), (sibling, agents.run_id)]
    c = [[SnapshotClient(a.store, run_id=a.run_id, rank=r, world=2, shm_dir=a.shm(r), siblings=(other,))
          for r in range(2)] for a, other in fams]
    everyone = [x for fam in c for x in fam]
    for x in everyone:
        x.save(1, state(1), {"step": 1})
    for x in everyone:
        x.wait_committed(1)
    os.kill(agents.procs[0].pid, signal.SIGSTOP)
    try:
        saved = {}
        for s in (2, 3):
            for f, fam in enumerate(c):
                for r, x in enumerate(fam):
                    saved[f, r, s] = x.save_async(s, state(s), {"step": s}, skip_if_busy=True)
                    x.wait()
            for f, fam in enumerate(c):
                for r, x in enumerate(fam):
                    if s == 2 and (f, r) != (0, 0):
                        x.wait_committed(2)
    finally:
        os.kill(agents.procs[0].pid, signal.SIGCONT)
    assert saved == {**{(f, r, 2): True for f in range(2) for r in range(2)},
                     **{(f, r, 3): False for f in range(2) for r in range(2)}}, saved
    assert all(agents.store.check([snapshot_keys(a.run_id).incomplete(3)]) for a, _ in fams)
    c[0][0].wait_committed(2)
    for x in everyone:
        x.save(4, state(4), {"step": 4})
    for x in everyone:
        x.wait_committed(4)
    for a, _ in fams:
        held = {r: sorted(s.get("step") for s in (SlotFile.open(data_path(a.shm(r), a.run_id, r, b))
                                                    for b in (0, 1))) for r in range(2)}
        assert held == {0: [2, 4], 1: [2, 4]}, (a.run_id, held)
    assert [fam[1].committed_steps() for fam in c] == [[2, 4], [2, 4]]


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
