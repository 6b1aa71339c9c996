"""Fixtures for snapshot tests: a TCPStore master in the test process, per-test /dev/shm dirs
(removed in teardown), agent processes started through the product's start_agent."""

from __future__ import annotations

import datetime
import shutil
import uuid
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from unbroken.runtime.snapshot.control import AgentSpec, Topology, start_agent, stop_agent


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=30))
    yield s


@pytest.fixture
def shm_root():
    root = Path("/dev/shm") / f"unbroken-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Agents:
    """Starts one agent per node, each with its own shm dir (a node's memory), and stops them."""

    def __init__(self, store: TCPStore, root: Path, run_id: str, topo: Topology, log_dir: Path):
        self.store, self.root, self.run_id, self.topo, self.log_dir = store, root, run_id, topo, log_dir
        self.procs: dict[int, object] = {}

    def shm(self, node: int) -> str:
        return str(self.root / f"node{node}")

    def start(self, node: int):
        spec = AgentSpec(f"127.0.0.1:{self.store.port}", self.run_id, node, self.topo,
                         self.shm(node), timeout_s=15)
        self.procs[node] = start_agent(spec, log=self.log_dir / f"agent{node}.log", store=self.store)
        return self.procs[node]

    def start_all(self) -> None:
        for n in range(self.topo.nodes):
            self.start(n)

    def kill_node(self, node: int) -> None:
        """A node is lost: its agent dies and its memory is gone."""
        p = self.procs.pop(node)
        p.kill()
        p.wait()
        shutil.rmtree(self.shm(node), ignore_errors=True)

    def stop(self) -> None:
        for p in self.procs.values():
            stop_agent(p)

    def logs(self) -> str:
        return "\n".join(f.read_text() for f in sorted(self.log_dir.glob("agent*.log")))


@pytest.fixture
def agents_factory(store, shm_root, tmp_path):
    made: list[Agents] = []

    def make(topo: Topology, run_id: str | None = None) -> Agents:
        a = Agents(store, shm_root, run_id or f"run-{uuid.uuid4().hex[:8]}", topo, tmp_path)
        made.append(a)
        a.start_all()
        return a

    yield make
    for a in made:
        a.stop()
