"""The launcher's snapshot agents: one per emulated node, started before the trainers, outliving them.

Owns: node directories (`snapshot.shm_dir/node{n}`: a node's CPU memory, gone when the node is lost),
starting the agents in parallel, replacing a lost node's agent and asking the survivors to rebuild its
shards from parity, and removing the run's files at the end. With replica groups of G ranks each agent
serves G snapshot families, one per shard index (`shard_run_id`): rank j of every group holds the same
state, snapshotted across the groups as a one-rank run's replicas are. Does not own: the agents' protocol
(snapshot/), or deciding when a node is lost (chaos.py, or a real node failure).
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed import Store

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.runtime.snapshot import AgentSpec, StateLoadError, Topology, request_rebuild, start_agent
from unbroken.runtime.launcher.zygote import Forked, Zygote
from unbroken.runtime.snapshot.control import node_dir, rebuild_step, remove_run, shard_run_ids
from unbroken.runtime.snapshot.errors import Unrecoverable


class AgentSet:
    def __init__(self, cfg: Config, address: str, store: Store, run_id: str, run_dir: Path, log: EventLog,
                 zygote: Zygote | None = None):
        s = cfg.snapshot
        self.cfg, self.address, self.store, self.run_id, self.log = cfg, address, store, run_id, log
        self.zygote = zygote  # forks each agent (and each replacement) where it forks: ~1.4 CPU-s less each
        self.logs = run_dir / "logs"
        self.shards = cfg.parallel.group_size
        # each family's "ranks" are the replica groups (its shares), laid on nodes as the groups are
        self.topology = Topology(nodes=s.nodes, ranks_per_node=cfg.run.replicas // s.nodes, parity=s.parity,
                                 k=s.k, m=s.m)
        self.procs: dict[int, subprocess.Popen | Forked] = {}
        with ThreadPoolExecutor(s.nodes) as pool:
            for n, p in zip(range(s.nodes), pool.map(self._start, range(s.nodes))):
                self.procs[n] = p

    def _start(self, node: int) -> subprocess.Popen | Forked:
        # 15 s per collective among agents (a shard moves in well under 1 s here): an encode that a
        # dead node left hanging must not hold the rebuild of that very node for a minute
        spec = AgentSpec(store=self.address, run_id=self.run_id, node=node, topology=self.topology,
                         shm_dir=node_dir(self.cfg.snapshot.shm_dir, node), timeout_s=15.0, shards=self.shards)
        fork = self.zygote is not None and self.zygote.usable()
        return start_agent(spec, log=self.logs / f"agent{node}.log", spawn=(
            lambda argv, log: self.zygote.spawn(argv[2], argv[3:], dict(os.environ), str(log))) if fork else None)

    def lose(self, node: int) -> None:
        """A node goes: its agent is SIGKILLed and its memory (this run's files in the node's shm directory)
        is gone. Only this run's: other runs on the same machine (tests side by side) emulate other nodes."""
        p = self.procs.pop(node, None)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        remove_run(node_dir(self.cfg.snapshot.shm_dir, node), self.run_id, self.shards)

    def replace(self, lost: list[int], rebuild: bool) -> int | None:
        """Start fresh agents for `lost` nodes; with `rebuild`, have the survivors rebuild their shards
        from parity (no trainer may be saving). Returns the rebuilt step, or None when it cannot."""
        for n in lost:
            self.procs[n] = self._start(n)
        if not (rebuild and lost):
            return None
        families = shard_run_ids(self.run_id, self.shards)
        survivors = [n for n in range(self.cfg.snapshot.nodes) if n not in lost]
        try:
            # one step for every shard index, the newest all of them sealed (control.py: the two-phase seal
            # keeps it held, with its parity, by every survivor of every family)
            step = rebuild_step(self.store, families, survivors)
            if step is None:
                raise Unrecoverable(f"no step sealed in every shard index and held with parity by nodes {survivors}")
            for r in families:
                request_rebuild(self.store, r, sorted(lost), step=step)
        except StateLoadError as e:
            self.log.emit("rebuild_failed", nodes=sorted(lost), error=str(e))
            return None
        self.log.emit("rebuilt", nodes=sorted(lost), step=step, parity=self.cfg.snapshot.parity)
        return step

    def close(self, keep_memory: bool = False) -> None:
        """Stop the agents and remove the run's files, unless `keep_memory`: then the nodes' slot files
        stay for `unbroken resume`, whose new agents adopt them (same run id)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if keep_memory:
            return
        for n in range(self.cfg.snapshot.nodes):
            remove_run(node_dir(self.cfg.snapshot.shm_dir, n), self.run_id, self.shards)
