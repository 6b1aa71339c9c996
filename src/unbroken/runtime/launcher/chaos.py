"""Faults the launcher injects from outside the trainers: a lost node, a crash of every trainer, bit rot.

Owns: firing `node`, `crash-all` and `corrupt` faults of the spec (worker-side kinds are faults.py's).
node:node=n,step=s     once step s-1 is committed: SIGKILL node n's agent and trainers, delete its memory
node:node=n,step=s,phase=parity   the same, inside a parity encode: node n's agent of the last shard
                           index stops inside its encode of the first snapshot at or after step s (its
                           parity slot torn, its peers blocked in the collective; the other shard indices
                           encode on), and the node is lost once two more steps committed after that
                           snapshot (the survivors have saved since: the window of a two-phase seal)
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
        for f in self.pending:
            if f.phase == "parity" and agents is not None:  # the agent holds inside that encode (operations.py)
                agents.store.set(snapshot_keys(self.families[-1]).hold(f.node), str(f.step))

    def _in_encode(self, f: Fault, step: int) -> int | None:
        """For a `node:...,phase=parity` fault: the snapshot step whose encode node f.node's agent holds, once
        `step` (committed) is two past it; else None (not yet)."""
        if self.agents is None:
            return None
        raw = get_json(self.agents.store, snapshot_keys(self.families[-1]).holding(f.node))
        return raw if raw is not None and step >= raw + 2 else None

    def on_committed(self, step: int, workers: dict[int, subprocess.Popen]) -> None:
        """Call for every committed step the launcher sees; fires faults scheduled for step + 1 (a node lost
        inside a parity encode: once the encode is held and two more steps committed)."""
        for f in [f for f in self.pending if f.kind in ("node", "crash-all")
                  and (f.step == step + 1 if f.phase != "parity" else self._in_encode(f, step) is not None)]:
            self.pending.remove(f)
            if f.kind == "node":
                victims = [r for r in workers if self.cfg.topology().node_of(r) == f.node]
                where = {"phase": "parity", "encoding": self._in_encode(f, step)} if f.phase == "parity" else {}
                self.log.emit("fault", kind="node", node=f.node, step=f.step, replicas=victims, **where)
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

    def _restore_step(self, limit: int, timeout_s: float = 10.0) -> int | None:
        """The step a memory restore will read (persistence.py's rule: the newest step at most `limit`, the
        log's last record, that every rank of every shard index holds committed, with its whole-state
        digest, sealed in every family: with parity, encoded on every node), once the agents have settled
        what the dead trainers left (no slot still COPIED, every whole step sealed or marked incomplete),
        or after timeout_s. Bit rot hits a stored snapshot: bytes flipped while the agents still encoded
        it would go into its parity too."""
        store, keys = self.agents.store, [snapshot_keys(f) for f in self.families]
        t0 = time.monotonic()
        while True:
            states = []
            for r in range(self.cfg.run.replicas):
                for j in range(len(self.families)):
                    for s in self._slots(r, j):
                        states.append(s.get("state"))
                        s.close()
            whole = self._whole_steps(keys, limit)
            open_ = [s for s in whole if not store.check([k.sealed(s) for k in keys])
                     and not store.check([keys[0].incomplete(s)])]
            if (State.COPIED not in states and not open_) or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.02)
        return max((s for s in whole if store.check([k.sealed(s) for k in keys])), default=None)

    def _whole_steps(self, keys: list, limit: int) -> set[int]:
        """The steps at most `limit` that every rank of every family holds committed, with their digests."""
        store, common = self.agents.store, None
        for k in keys:
            held: dict[str, list[int]] = {}
            for n in range(self.cfg.snapshot.nodes):
                held.update(get_json(store, k.held(n), {}))
            for r in range(self.cfg.run.replicas):
                mine = {s for s in held.get(str(r), []) if s <= limit and store.check([k.digest(s)])}
                common = mine if common is None else common & mine
        return common or set()

    def _corrupt(self, replica: int, limit: int) -> int | None:
        """Flip 64 payload bytes of the replica's committed slot of the step a restore will read;
        returns that step (None: no such slot, nothing flipped)."""
        target = self._restore_step(limit)
        slots = self._slots(replica)
        done = [s for s in slots if s.get("state") == State.COMMITTED and s.get("step") == target]
        if done:
            payload = done[0].payload()
            payload[:64] = payload[:64] ^ 0xFF
        for s in slots:
            s.close()
        return target if done else None

    def take_lost_nodes(self) -> list[int]:
        lost, self.lost_nodes = self.lost_nodes, []
        return lost
