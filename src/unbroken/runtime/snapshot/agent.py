"""The snapshot agent: one process per node that owns the node's snapshot memory.

Owns: the node's slot files in /dev/shm (two per local trainer rank, two parity files per layer),
checksumming and committing copies the trainers finished, publishing what it holds, sealing steps
(`sealed/<step>`: with parity, once every node's encode of the step succeeded; without, once every rank
committed it), and running the command queue (parity encode, rebuild) with its peer agents. Does not
own the trainers' copies (client.py) or the coding math (parity.py, erasure.py).

In replica groups of G ranks the one process per node runs G agents, a thread and a store client each,
one per shard index (`--shards G`, `control.shard_run_id`): rank j of every group holds the same state.

Started before the trainers (`start_agent` in control.py, or
`python -m unbroken.runtime.snapshot.agent --store HOST:PORT --run-id ID --node N ...`) and outlives
them: SIGKILL of every trainer leaves the agent, its files and its commits intact. SIGTERM stops it
and leaves the files (remove_run deletes them at the end of a run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import xxhash

from . import operations
from .checksum import checksum, folded_digest
from unbroken.runtime.store.etcd import EtcdStore
from unbroken.runtime.store.client import connect, get_json
from unbroken.runtime.parallel.netif import bind_gloo_interface

from .control import Topology, post_command, shard_run_ids, snapshot_keys, topology_dict
from .shm import Kind, SlotFile, State, data_path, parity_path

POLL_SHM_S = 0.003  # header scans are microseconds; commits start within a few ms of a copy
POLL_STORE_S = 0.02  # store round trips: alloc requests and commands
# ... when the store is etcd (--coord.store): each poll is two HTTP requests and a read on the Raft
# leader; at 50 polls a second per agent, etcd's CPU took most of 2 cores and a 0.1 s step took ~1 s.
# Requests (a slot's first allocation) and commands (parity, rebuild) wait up to this long instead.
POLL_ETCD_S = 0.25
SLOW_COMMAND_S = 2.0  # a command this long is logged (a stalled peer, a loaded host)


def doc_digest(doc: dict) -> int:
    """Identity of a snapshot's layout and meta (all replicas hold the same state)."""
    raw = json.dumps([doc.get("layout"), doc.get("meta")], sort_keys=True).encode()
    return xxhash.xxh3_64_intdigest(raw)


class SnapshotAgent:
    """Call `serve()` (blocks) or `poll()` repeatedly. One per (run, node)."""

    def __init__(self, store: dist.Store, run_id: str, node: int, topo: Topology, shm_dir: str,
                 reconnect: Callable[[], dist.Store], timeout_s: float = 60.0, nonce: str = "",
                 siblings: tuple[str, ...] = ()) -> None:
        self.store, self.run_id, self.node, self.topo = store, run_id, node, topo
        # the other shard indices' run ids: a failed encode marks the step incomplete in theirs too
        self.marks = (snapshot_keys(run_id), *map(snapshot_keys, siblings))
        # commands' gloo groups form on clients of their own, from `reconnect` (operations.Rendezvous)
        self.rendezvous = operations.Rendezvous(reconnect)
        self.shm_dir, self.timeout_s, self.keys = shm_dir, timeout_s, snapshot_keys(run_id)
        self.ranks = topo.ranks_of(node)
        self.data = {r: [self._adopt(data_path(shm_dir, run_id, r, b), r) for b in (0, 1)]
                     for r in self.ranks}
        self.parity = {i: [self._adopt(parity_path(shm_dir, run_id, i, b), i) for b in (0, 1)]
                       for i in range(topo.ranks_per_node)}
        self._alloc_nonce: dict[int, str] = {}
        self._req_seen = -1
        self._cmd_seen = store.add(self.keys.cmd("n"), 0)  # commands before we came up are not ours
        self._stop = threading.Event()
        self.poll_store_s = POLL_ETCD_S if isinstance(store, EtcdStore) else POLL_STORE_S
        self._scan()  # commit copies a previous agent left COPIED
        self._republish()
        self.publish()
        # `since`: the first command this agent serves; peers waiting on an older one for this node
        # give up at once instead of after their timeout (operations._given_up)
        store.set(self.keys.agent(node), json.dumps(
            {"topology": topology_dict(topo), "nonce": nonce, "pid": os.getpid(),
             "since": self._cmd_seen + 1}))

    # -- slot files -------------------------------------------------------------------------
    def _adopt(self, path: Path, rank: int) -> SlotFile | None:
        try:
            slot = SlotFile.open(path)
        except (FileNotFoundError, ValueError, RuntimeError):
            return None
        h = slot.header()
        if h.run_id != self.run_id or h.world != self.topo.world or h.rank != rank:
            slot.close()  # not ours: recreated on the next alloc request
            return None
        return slot

    def find(self, slots: list[SlotFile | None], step: int) -> SlotFile | None:
        """The committed slot holding `step`, if any."""
        for s in slots:
            if s and s.get("state") == State.COMMITTED and s.get("step") == step:
                return s
        return None

    def writable(self, slots: list[SlotFile | None], path_of, capacity: int, rank: int,
                 kind: Kind, keep_step: int | None = None, spare: int | None = None) -> SlotFile:
        """A slot to overwrite: the one holding `keep_step` if given, else the one not holding `spare`
        (a step that must stay), else not the newest commit; created or grown to `capacity` payload bytes."""
        steps = [s.get("step") if s and s.get("state") == State.COMMITTED else -2 for s in slots]
        if keep_step in steps:
            b = steps.index(keep_step)
        elif spare is not None and spare in steps:
            b = 1 - steps.index(spare)
        else:
            b = 0 if steps[0] <= steps[1] else 1
        if slots[b] is None or slots[b].get("capacity") < capacity:
            if slots[b]:
                slots[b].close()
            slots[b] = SlotFile.create(path_of(b), capacity, kind=kind, run_id=self.run_id,
                                       rank=rank, world=self.topo.world, node=self.node)
        return slots[b]

    def publish(self) -> None:
        held = {r: sorted(s.get("step") for s in sl if s and s.get("state") == State.COMMITTED)
                for r, sl in self.data.items()}
        par = [set(s.get("step") for s in sl if s and s.get("state") == State.COMMITTED)
               for sl in self.parity.values()]
        self.store.set(self.keys.held(self.node), json.dumps(held))
        self.store.set(self.keys.parity(self.node), json.dumps(sorted(set.intersection(*par))))

    # -- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        """Run until stop() or SIGTERM/SIGINT."""
        last = 0.0
        while not self._stop.is_set():
            self._scan()
            if time.monotonic() - last > self.poll_store_s:
                self._requests()
                self._commands()
                last = time.monotonic()
            time.sleep(POLL_SHM_S)

    def stop(self) -> None:
        self._stop.set()

    def _scan(self) -> None:
        for r, slots in self.data.items():
            for s in slots:
                if s and s.get("state") == State.COPIED:
                    self._commit(r, s)

    def _commit(self, rank: int, slot: SlotFile) -> None:
        # The checksum runs here, off the trainer's critical path. Only the agent moves
        # COPIED -> COMMITTED and the trainer never writes a COPIED slot, so no race.
        h = slot.header()
        digest = checksum(slot.payload()[: h.length])
        slot.set(checksum=digest)
        slot.set(state=int(State.COMMITTED))
        self._record(rank, slot, publish=True)

    def _record(self, rank: int, slot: SlotFile, publish: bool, encode: bool = True) -> None:
        """Put a COMMITTED slot's record in the store (its checksum from the header); the last rank of
        the step to do so seals it (`_all_committed`)."""
        h, doc = slot.header(), slot.doc()
        rec = {"length": h.length, "checksum": h.checksum, "offset": doc["offset"], "total": doc["total"],
               "doc_digest": doc_digest(doc)}
        self.store.set(self.keys.commit(h.step, rank), json.dumps(rec))
        if publish:
            self.publish()
        first = self.store.add(self.keys.first(h.step, rank), 1) == 1
        if first and self.store.add(self.keys.ncommit(h.step), 1) == self.topo.world:
            self._all_committed(h.step, rec["total"], encode)
        self.store.set(self.keys.committed(h.step, rank), "1")  # wait_committed returns now

    def _republish(self) -> None:
        """A store that does not know this node's memory (`unbroken resume`: the coordinator that held
        the old store was lost, the node's slot files were not): put back the records of the committed
        slots adopted from it, so a restore can find and verify them. The checksums are the ones
        computed at commit time (headers). Parity is not re-encoded: the parity slots adopted with
        them hold what was encoded before (publish() reports it); a peer agent may not be up yet to
        take a command. A store that has the records already (an agent replaced mid-run) is left as is,
        but a step whose records are all there without its digest is sealed here: the agent that wrote
        the last record was killed before it counted it (the launcher kills the agents first when the
        coordinator is lost; CI found `ncommit/5` at 1 with both records of step 5 written, and the
        resumed run held no sealed step at or below the log's last record, so it started over)."""
        for rank, slots in self.data.items():
            for slot in slots:
                if slot is None or slot.get("state") != State.COMMITTED:
                    continue
                step = slot.get("step")
                if not self.store.check([self.keys.commit(step, rank)]):
                    self._record(rank, slot, publish=False, encode=False)
                if not self.store.check([self.keys.digest(step)]) and self.store.check(
                        [self.keys.commit(step, r) for r in range(self.topo.world)]):
                    self._all_committed(step, slot.doc()["total"], encode=False)  # the same digest: idempotent
        if self.topo.parity != "none":  # a fresh store (resume): the seals of the parity adopted with the slots
            for step in operations.held_with_parity(self):
                self.seal(step)

    def _all_committed(self, step: int, total: int, encode: bool = True) -> None:
        # The last rank to commit seals the step: whole-state digest, then parity across nodes.
        recs = [json.loads(self.store.get(self.keys.commit(step, r))) for r in range(self.topo.world)]
        self.store.set(self.keys.digest(step), str(folded_digest([r["checksum"] for r in recs], total)))
        if self.topo.parity == "none":
            self.store.set(self.keys.sealed(step), "whole")  # nothing to encode: whole is sealed
        elif encode:
            post_command(self.store, self.run_id, {"op": "parity", "step": step})

    def seal(self, step: int) -> None:
        """Count this node's parity of `step` (once per node, so an agent that adopts its predecessor's
        slots never counts twice); the last node to count seals the step in this family (`sealed/<step>`).
        Call after a successful encode, before publishing it, or for parity adopted from slot files. A trainer overwrites its
        older slot only once its newer step is sealed in every family (client._pick_slot): phase two."""
        if self.store.add(self.keys.pfirst(step, self.node), 1) == 1 and \
                self.store.add(self.keys.nsealed(step), 1) == self.topo.nodes:
            self.store.set(self.keys.sealed(step), "parity")

    def sealed(self, step: int) -> bool:
        """`step` is sealed in every shard index's family (this agent's and its siblings'). One round trip."""
        return self.store.check([keys.sealed(step) for keys in self.marks])

    def _requests(self) -> None:
        n = self.store.add(self.keys.req(self.node), 0)
        if n == self._req_seen:
            return
        self._req_seen = n
        for r in self.ranks:
            req = get_json(self.store, self.keys.alloc(r))
            if not req or self._alloc_nonce.get(r) == req["nonce"]:
                continue
            for b in (0, 1):
                s = self.data[r][b]
                if s is None or s.get("capacity") < req["capacity"]:
                    if s:
                        s.close()
                    self.data[r][b] = SlotFile.create(
                        data_path(self.shm_dir, self.run_id, r, b), req["capacity"], kind=Kind.DATA,
                        run_id=self.run_id, rank=r, world=self.topo.world, node=self.node)
            self._alloc_nonce[r] = req["nonce"]
            self.publish()
            self.store.set(self.keys.alloc_done(r, req["nonce"]), str(req["capacity"]))

    def _commands(self) -> None:
        n = self.store.add(self.keys.cmd("n"), 0)
        while self._cmd_seen < n:
            self._cmd_seen += 1
            i = self._cmd_seen
            cmd = json.loads(self.store.get(self.keys.cmd(i)))
            t0 = time.monotonic()
            try:
                step = operations.run(self, i, cmd)
                answer = f"ok {step}"
            except Exception as e:  # noqa: BLE001 - reported to the requester, agent keeps serving
                answer = f"error {type(e).__name__} {' '.join(str(e).split())}"
                operations.abandon(self, i, answer)
            took = time.monotonic() - t0
            if answer.startswith("error") or took > SLOW_COMMAND_S:
                print(f"[agent {self.node}] command {i} {cmd['op']} (step {cmd.get('step')}): "
                      f"{answer} after {took:.2f} s", file=sys.stderr, flush=True)
            if cmd["op"] == "parity" and answer.startswith("error"):  # (an ok one sealed: operations._parity)
                # the step has no parity here and never will (a peer node lost mid-encode, a rank's shard
                # missing): it is never sealed, and trainers overwrite it rather than the older step, which
                # is sealed in every family (what a rebuild needs)
                for keys in self.marks:
                    self.store.set(keys.incomplete(cmd["step"]), f"parity failed on node {self.node}")
            self.store.set(self.keys.cmd(i, "done", self.node), answer)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unbroken.runtime.snapshot.agent",
                                description="unbroken snapshot agent (one per node)")
    p.add_argument("--store", default=os.environ.get("UNBROKEN_STORE"), help="host:port")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--parity", choices=["none", "xor", "rs"], default="none")
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--m", type=int, default=0)
    p.add_argument("--shm-dir", default="/dev/shm/unbroken")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds, collectives among agents")
    p.add_argument("--nonce", default="")
    p.add_argument("--shards", type=int, default=1,
                   help="ranks per replica group: serve each shard index's snapshots (a thread each)")
    a = p.parse_args(argv)
    if os.environ.get("UNBROKEN_FORKED"):
        # forked from the launcher's server, whose torch started with the trainers' OMP_NUM_THREADS: the
        # parity and checksum work gets the threads a fresh interpreter would take from this environment
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    if a.store:  # its parity groups with the other hosts' agents: the interface that reaches the store
        bind_gloo_interface(a.store, os.environ)
    topo = Topology(a.nodes, a.ranks_per_node, a.parity, a.k, a.m)
    # One SnapshotAgent per shard index, each with its own store client and thread: an agent blocks in
    # collectives with its peers (parity, rebuild), and shard j's peers must never wait for shard i's.
    families = shard_run_ids(a.run_id, a.shards)
    agents = [SnapshotAgent(connect(a.store), run_id, a.node, topo, a.shm_dir, lambda: connect(a.store),
                            a.timeout, a.nonce, tuple(f for f in families if f != run_id))
              for run_id in families]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [agent.stop() for agent in agents])
    threads = [threading.Thread(target=agent.serve, name=f"agent-{agent.run_id}", daemon=True)
               for agent in agents[1:]]
    for t in threads:
        t.start()
    agents[0].serve()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
