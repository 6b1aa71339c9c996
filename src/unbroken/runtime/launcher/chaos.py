"""Faults the launcher injects from outside the trainers: a lost node, a crash of every trainer, bit rot.

Owns: firing `node`, `crash-all` and `corrupt` faults of the spec (worker-side kinds are faults.py's).
node:node=n,step=s     once step s-1 is committed: SIGKILL node n's agent and trainers, delete its memory
crash-all:step=s       once step s-1 is committed: SIGKILL every trainer at once
corrupt:replica=r,step=s   at the first restart after step s: flip bytes in replica r's stored shard
                           of the step a memory restore will read (the newest every replica holds
                           committed; once its parity is encoded), so the checksum path must catch it
                           (in replica groups: the shard of the group's rank 0)
A trainer is killed with everything under it: in replica groups the launcher's child is a torchrun agent
whose workers run in sessions of their own.
Each fault fires once per run, whatever restarts follow. Also reports, at each restart, every snapshot
slot left mid-copy by a writer that died copying (`torn` records: what a `tear` fault must leave).
Does not own: recovering (launcher, agents).
"""
from __future__ import annotations

import signal
import subprocess
import time

from unbroken.events import EventLog
from unbroken.faultspec import Fault
from unbroken.runtime.launcher.agents import AgentSet
from unbroken.runtime.launcher.processes import signal_tree
from unbroken.runtime.store.client import get_json
from unbroken.runtime.snapshot.control import node_dir, shard_run_ids, snapshot_keys
from unbroken.runtime.snapshot.shm import SlotFile, State, data_path


class Chaos:
    def __init__(self, faults: tuple[Fault, ...], cfg, log: EventLog, agents: AgentSet | None, run_id: str):
        self.cfg, self.log, self.agents, self.run_id = cfg, log, agents, run_id
        self.families = shard_run_ids(run_id, cfg.parallel.group_size)  # snapshot run ids, by shard index
        self.pending = [f for f in faults if f.kind in ("node", "crash-all", "corrupt")]
        self.lost_nodes: list[int] = []

    def on_committed(self, step: int, workers: dict[int, subprocess.Popen]) -> None:
        """Call for every committed step the launcher sees; fires faults scheduled for step + 1."""
        for f in [f for f in self.pending if f.kind in ("node", "crash-all") and f.step == step + 1]:
            self.pending.remove(f)
            if f.kind == "node":
                victims = [r for r in workers if self.cfg.topology().node_of(r) == f.node]
                self.log.emit("fault", kind="node", node=f.node, step=f.step, replicas=victims)
            else:
                victims = list(workers)
                self.log.emit("fault", kind="crash-all", step=f.step, replicas=victims)
            # the trainers first: a node's processes die at once, and losing its agent (reaping it, removing
            # its memory) took 0.55 s in a CI run, while the node's trainers committed the run's last 4 steps
            for r in victims:
                signal_tree(workers[r], signal.SIGKILL)
            if f.kind == "node" and self.agents is not None:
                self.agents.lose(f.node)
                self.lost_nodes.append(f.node)

    def before_restart(self, last_committed: int) -> None:
        """Call with all trainers stopped, before a restart: report torn slots, apply due corruptions."""
        if self.agents is None:
            return
        self._report_torn()
        for f in [f for f in self.pending if f.kind == "corrupt" and f.step <= last_committed]:
            self.pending.remove(f)
            self.log.emit("fault", kind="corrupt", replica=f.replica, step=f.step,
                          corrupted_step=self._corrupt(f.replica, last_committed))

    def _slots(self, replica: int, family: int = 0) -> list[SlotFile]:
        """The replica's data slot files of shard index `family` that exist on its node (the caller
        closes them)."""
        paths = [data_path(node_dir(self.cfg.snapshot.shm_dir, self.cfg.topology().node_of(replica)),
                           self.families[family], replica, b) for b in (0, 1)]
        return [SlotFile.open(p) for p in paths if p.exists()]

    def _report_torn(self) -> None:
        """A `torn` record for each slot still WRITING: its writer died copying (the agent commits
        only slots marked COPIED, so a restore never reads one)."""
        for r in range(self.cfg.run.replicas):
            for j in range(len(self.families)):
                for s in self._slots(r, j):
                    if s.get("state") == State.WRITING:
                        self.log.emit("torn", replica=r, step=s.get("step"), **({"rank": j} if j else {}))
                    s.close()

    def _restore_step(self, limit: int, timeout_s: float = 5.0) -> int | None:
        """The step a memory restore will read (Persistence's rule: the newest every replica holds
        committed, with its whole-state digest, at most `limit`, the log's last record; in replica
        groups the oldest of those over the shard indices, as the restore agrees), once the agents have committed what the
        dead trainers finished copying (no slot left COPIED), or after timeout_s."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            states = []
            for r in range(self.cfg.run.replicas):
                for j in range(len(self.families)):
                    for s in self._slots(r, j):
                        states.append(s.get("state"))
                        s.close()
            if State.COPIED not in states:
                break
            time.sleep(0.02)
        newest = []
        for family in self.families:
            keys, store = snapshot_keys(family), self.agents.store
            held: dict[str, list[int]] = {}
            for n in range(self.cfg.snapshot.nodes):
                held.update(get_json(store, keys.held(n), {}))
            common = set.intersection(*(set(held.get(str(r), [])) for r in range(self.cfg.run.replicas)))
            newest.append(max((s for s in common if s <= limit and store.check([keys.digest(s)])), default=None))
        return None if None in newest else min(newest)

    def _corrupt(self, replica: int, limit: int) -> int | None:
        """Flip 64 payload bytes of the replica's committed slot of the step a restore will read;
        returns that step (None: no such slot, nothing flipped)."""
        target = self._restore_step(limit)
        slots = self._slots(replica)
        done = [s for s in slots if s.get("state") == State.COMMITTED and s.get("step") == target]
        if not done:
            for s in slots:
                s.close()
            return None
        newest = done[0]
        self._settle(self.cfg.topology().node_of(replica), newest.get("step"))
        payload = newest.payload()
        payload[:64] = payload[:64] ^ 0xFF
        step = newest.get("step")
        for s in slots:
            s.close()
        return step

    def _settle(self, node: int, step: int, timeout_s: float = 20.0) -> None:
        """Wait until the node's agent has encoded the parity of `step`, if it will: bit rot hits a
        stored snapshot. (Bytes flipped while the agents still encode would go into the parity too;
        the rebuilt shard then fails its checksum and an older snapshot is used: also never loaded,
        but not the rebuild path this fault is for.) A step that not every rank committed gets no
        parity: after 2 s without its whole-state digest, go on."""
        if self.agents is None or self.cfg.snapshot.parity == "none":
            return
        keys, store = snapshot_keys(self.families[0]), self.agents.store
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if int(get_json(store, keys.pdone(node), -1)) >= step or store.check([keys.incomplete(step)]):
                return  # encoded, or never will be (an encode failed)
            if time.monotonic() - t0 > 2 and not store.check([keys.digest(step)]):
                return
            time.sleep(0.02)

    def take_lost_nodes(self) -> list[int]:
        lost, self.lost_nodes = self.lost_nodes, []
        return lost
