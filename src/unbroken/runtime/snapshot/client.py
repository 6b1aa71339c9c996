"""The trainer's side of in-memory snapshots: asynchronous save into the node agent's slots, and
restore (local shards from shm, other nodes' shards over the trainers' own process group).

Owns the trainer half of the slot protocol (EMPTY/COMMITTED -> WRITING -> COPIED) and restore
verification. Does not own checksumming at save time or parity (the agent does both, off the
trainer's critical path) nor the decision when to save (the trainer calls every K steps).

Saving: replica r of R copies only bytes shard_bounds(T, R, r) of the flat state (REFT sharding).
Consistency contract of save_async: the caller must not modify the passed tensors until wait()
returns (e.g. call save_async right after optimizer.step() and wait() before the next one; forward
and backward only read parameters and optimizer state). Use save() to copy synchronously.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import errors
from .checksum import checksum, folded_digest
from unbroken.runtime.store.client import get_json

from .control import DEFAULT_SHM_DIR, Topology, read_topology, request_rebuild, snapshot_keys
from .layout import Layout, check_out, copy_range_in, copy_range_out, shard_bounds, unflatten
from .shm import Header, Kind, SlotFile, State, check_run_id, data_path, read_header


@dataclass(frozen=True)
class Restored:
    step: int
    tensors: dict[str, torch.Tensor]  # the `out` tensors when given, else views of one buffer
    meta: dict


class SnapshotClient:
    """One per trainer rank. `store` is a client of the coordinator's TCPStore; the node's agent
    must be running (start_agent) and publishes the topology: rank r lives on node
    r // ranks_per_node."""

    def __init__(self, store: dist.Store, *, run_id: str, rank: int, world: int,
                 shm_dir: str = DEFAULT_SHM_DIR, timeout_s: float = 60.0, siblings: tuple[str, ...] = ()) -> None:
        self.store, self.run_id, self.rank, self.world = store, check_run_id(run_id), rank, world
        self.shm_dir, self.timeout_s, self.keys = shm_dir, timeout_s, snapshot_keys(run_id)
        # the other shard indices' run ids (replica groups of several ranks): a step this rank skips is
        # marked incomplete in theirs too, so every shard index keeps the same older step and a restore
        # or rebuild finds one step that all of them hold (control.shard_run_id)
        self.marks = (self.keys, *map(snapshot_keys, siblings))
        self.topo: Topology | None = None
        self._slots: list[SlotFile] | None = None
        self._asked: tuple[str, int] | None = None  # (nonce, capacity) of an alloc request not yet served
        # Read mappings of slot files, kept open between restores: mapping (MAP_POPULATE) and
        # unmapping a 1.2 GB slot cost ~0.1 s per file here. Keyed by path, reused while the file
        # is the same (device, inode, size): the agent replaces a slot file to grow it.
        self._maps: dict[Path, tuple[tuple[int, int, int], SlotFile]] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._layout: Layout | None = None
        self.rejected: list[tuple[int, int]] = []  # (rank, step) of each shard that failed its checksum

    @property
    def node(self) -> int:
        return self.rank // self._topology().ranks_per_node

    def _topology(self) -> Topology:
        if self.topo is None:
            self.topo = read_topology(self.store, self.run_id, 0, self.timeout_s)
            if self.topo.world != self.world:
                raise errors.WorldSizeMismatch(f"trainer world {self.world} but the snapshot "
                                               f"agents serve {self.topo.world} ranks")
        return self.topo

    # -- save -------------------------------------------------------------------------------
    def save_async(self, step: int, tensors: Mapping[str, torch.Tensor], meta: dict,
                   skip_if_busy: bool = False, gate: threading.Event | None = None,
                   skip_until_allocated: bool = False) -> bool:
        """Start copying this rank's share of `tensors` (and `meta`, JSON-able) for `step`; returns
        once the copy runs on a background thread. Waits for the previous save first. When the agent
        is two snapshots behind (backpressure) it blocks up to timeout_s, or with `skip_if_busy`
        returns False at once and saves nothing (the older snapshots stay whole). The first call
        blocks while the agent creates the slots; with `skip_until_allocated` it asks once and returns
        False until the agent has: for a share adopted from a lost node, whose replacement agent takes
        seconds to start (it imports torch), or never comes on a cluster with no spare. With `gate`,
        the copy thread marks the slot torn (WRITING) and waits for the gate before copying a byte: a
        fault fired meanwhile dies mid-snapshot for certain. Returns True when a copy started."""
        self.wait()
        layout = self._layout if self._layout and _same(self._layout, tensors) else Layout.of(tensors)
        self._layout = layout
        lo, hi = shard_bounds(layout.total, self.world, self.rank)
        slot = self._pick_slot(hi - lo, wait=not skip_if_busy, wait_alloc=not skip_until_allocated)
        if slot is None:
            # said before this rank lets the next step commit: the other ranks' next save reads it and
            # keeps their older slot rather than this step's (`_pick_slot`), so one step stays common
            for keys in self.marks:
                self.store.set(keys.incomplete(step), f"skipped by rank {self.rank} of {self.run_id}")
            return False
        slot.set(state=int(State.WRITING))  # from here on the slot is torn until COPIED
        slot.set(gen=slot.get("gen") + 1, step=step, length=hi - lo, checksum=0)
        slot.set_doc({"layout": layout.to_json(), "meta": meta, "offset": lo,
                      "total": layout.total, "world": self.world})

        def copy() -> None:
            try:
                if gate is not None:
                    gate.wait()
                copy_range_out(tensors, layout, lo, hi, slot.payload())
                slot.set(state=int(State.COPIED))  # the agent checksums and commits it
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e

        self._thread = threading.Thread(target=copy, name="unbroken-snapshot", daemon=True)
        self._thread.start()
        return True

    def wait(self) -> None:
        """Block until the pending copy is in shared memory (not yet verified: see
        wait_committed); re-raises an error of the copy thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """save_async + wait."""
        self.save_async(step, tensors, meta)
        self.wait()

    def wait_committed(self, step: int, timeout_s: float | None = None) -> None:
        """Block until the agent verified and committed this rank's snapshot of `step` and
        published it (if the last rank to commit: with the whole-state digest)."""
        try:
            self.store.wait([self.keys.committed(step, self.rank)], _td(timeout_s or self.timeout_s))
        except Exception:  # noqa: BLE001 - the store raises DistStoreError on timeout
            raise TimeoutError(f"snapshot of step {step} not committed by the agent") from None

    def _open_slots(self, need: int, wait: bool = True) -> list[SlotFile] | None:
        """This rank's two slots with room for `need` bytes; None, without `wait`, while the agent has
        not yet created them."""
        if self._slots is None or any(s.get("capacity") < need for s in self._slots):
            self._close_slots()
            paths = [data_path(self.shm_dir, self.run_id, self.rank, b) for b in (0, 1)]
            ok = all(p.exists() for p in paths)
            slots = [SlotFile.open(p) for p in paths] if ok else []
            if not ok or any(s.get("capacity") < need or s.header().run_id != self.run_id
                             or s.get("world") != self.world for s in slots):
                for s in slots:
                    s.close()
                slots = self._allocate(paths, need, wait)
                if slots is None:
                    return None
            self._slots = slots
        return self._slots

    def _allocate(self, paths: list[Path], need: int, wait: bool = True) -> list[SlotFile] | None:
        """The agent owns the files: ask it to create (and pre-fault) both slots, then map them. The
        request is made once (an agent that starts later serves it: agent._requests reads every rank's
        pending request); without `wait`, returns None while it is pending."""
        if self._asked is None or self._asked[1] < need:
            self._asked = (secrets.token_hex(6), max(need, 1))
            self.store.set(self.keys.alloc(self.rank), json.dumps({"capacity": self._asked[1],
                                                                   "nonce": self._asked[0]}))
            self.store.add(self.keys.req(self.node), 1)
        done = self.keys.alloc_done(self.rank, self._asked[0])
        if not wait and not self.store.check([done]):
            return None
        try:
            self.store.wait([done], _td(self.timeout_s))
        except Exception:  # noqa: BLE001
            raise RuntimeError(f"snapshot agent of node {self.node} did not create slots for rank "
                               f"{self.rank} within {self.timeout_s:g} s") from None
        self._asked = None
        return [SlotFile.open(p) for p in paths]

    def _pick_slot(self, need: int, wait: bool = True, wait_alloc: bool = True) -> SlotFile | None:
        """The slot to write; None without `wait` when both are busy, or without `wait_alloc` while
        the agent has not created them yet (the step is then skipped as a busy agent's is)."""
        slots = self._open_slots(need, wait=wait_alloc)
        if slots is None:
            return None
        deadline = time.monotonic() + self.timeout_s
        while True:
            b = self._overwritable([(s.get("state"), s.get("step")) for s in slots])
            if b is not None:
                return slots[b]
            if not wait:
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot agent of node {self.node} is two snapshots behind")
            time.sleep(0.002)

    def _overwritable(self, st: list[tuple[int, int]]) -> int | None:
        """Which of the two slots (state, step) may be overwritten now, or None: the two-phase seal.

        A slot that holds nothing (empty, or torn by a writer that died) is free. Of two held steps, one
        marked incomplete (a rank skipped it, or an encode of it failed) is never sealed: overwrite it,
        the older first. Otherwise the older goes only once the newer is sealed in every shard index's
        family (`sealed/<step>`: with parity, every node encoded it; without, every rank committed it).
        So a step that every family sealed stays held by every rank of every family, with its parity,
        until a newer one is: a node lost at any moment, even inside one family's encode while another
        family has finished, leaves one step that every family can rebuild and restore. A slot the agent
        has not committed yet (COPIED) is never taken: the agent may be checksumming it."""
        held = [b for b in (0, 1) if st[b][0] in (State.COPIED, State.COMMITTED)]
        free = [b for b in (0, 1) if b not in held]
        if free:
            return free[0]
        older, newer = sorted(held, key=lambda b: st[b][1])
        for b in (older, newer):
            if st[b][0] == State.COMMITTED and (self._incomplete(st[b][1]) or self._abandoned(st[b][1])):
                return b
        if st[older][0] == State.COMMITTED and st[newer][0] == State.COMMITTED and self._sealed(st[newer][1]):
            return older
        return None

    def _sealed(self, step: int) -> bool:
        """`step` is sealed in every shard index's family (this one and its siblings). One round trip."""
        return self.store.check([keys.sealed(step) for keys in self.marks])

    def _abandoned(self, step: int) -> bool:
        """`step` will never be whole: some rank committed a later step without it (it died before its copy
        of `step`, or tore it, and its share moved on: its adopter's next save, or its own after a restart).
        Marks it incomplete in every family, as a skip does, so the other ranks need not ask again. Reads
        every node's published holdings: call only where the step is neither sealed nor marked."""
        if self.store.check([self.keys.digest(step)]):
            return False  # whole: it will be sealed, or its encode fails and marks it
        held: dict[str, list[int]] = {}
        for n in range(self._topology().nodes):
            held.update(get_json(self.store, self.keys.held(n), {}))
        if not any(step not in steps and max(steps, default=-1) > step for steps in held.values()):
            return False
        for keys in self.marks:
            self.store.set(keys.incomplete(step), f"a rank moved past it without it (seen by rank {self.rank} of {self.run_id})")
        return True

    def _incomplete(self, step: int) -> bool:
        """Some rank skipped its save of `step` (its agent was behind), or an agent's parity encode of
        it failed: `step` will never be a whole snapshot with parity. One store round trip."""
        return self.store.check([self.keys.incomplete(step)])

    # -- restore ----------------------------------------------------------------------------
    def latest_committed(self) -> int | None:
        """Newest step committed by every rank and still held in the agents' slots, else None."""
        return max(self.committed_steps(), default=None)

    def committed_steps(self) -> list[int]:
        """The steps committed by every rank (whole-state digest written), sealed in every shard index's
        family (with parity: encoded on every node, so a shard that fails its checksum can be rebuilt)
        and still held in the agents' slots, ascending; at most two. Reads the store: call before a
        restore, not per step."""
        topo = self._topology()
        common: set[int] | None = None
        for n in range(topo.nodes):
            held = get_json(self.store, self.keys.held(n), {})
            for r in topo.ranks_of(n):
                steps = set(held.get(str(r), []))
                common = steps if common is None else common & steps
        return sorted(s for s in (common or ()) if self.store.check([self.keys.digest(s)]) and self._sealed(s))

    def restore(self, step: int | None = None, *, group: dist.ProcessGroup | None = None,
                out: Mapping[str, torch.Tensor] | None = None) -> Restored:
        """Load the snapshot of `step` (default: latest_committed()).

        group=None: every rank must live on this node (single node); the shards are read from
        this node's slots. Otherwise pass the trainers' group whose rank i is trainer rank i;
        this is a collective over it. With `out`, bytes land in those tensors (same names,
        dtypes, shapes) and nothing else is allocated. Every shard is verified against its
        checksum (a corrupt one is rebuilt from parity by the agents, never loaded) and the whole
        reassembled state against the digest recorded at snapshot time. Raises a StateLoadError
        subclass and loads nothing on failure.
        """
        self.wait()
        self._check_files()  # missing / foreign / other world: fail before touching the store
        topo = self._topology()
        step = self.latest_committed() if step is None else step
        if step is None:
            raise errors.SnapshotNotFound(f"no snapshot committed by all {self.world} ranks of run "
                                          f"{self.run_id}")
        if group is None and topo.nodes > 1:
            raise ValueError("ranks live on several nodes: pass the trainers' process group")
        mine = topo.ranks_of(self.node) if group is None else [self.rank]
        shards = {r: self._verified_shard(r, step) for r in mine}
        doc = next(iter(shards.values()))[1]
        layout, total = Layout.from_json(doc["layout"]), doc["total"]
        digest = int(self.store.get(self.keys.digest(step)))
        if group is None:
            # Every shard was just checksummed in shm: fold them into the whole-state digest.
            got = folded_digest([shards[r][2] for r in range(self.world)], total)
            _expect(got, digest, f"state of step {step}")
            if out is not None:
                check_out(out, layout)
            for r, (data, _, _) in shards.items():
                lo, hi = shard_bounds(total, self.world, r)
                if out is not None:
                    copy_range_in(data, layout, lo, hi, out)
            flat = None if out is not None else torch.cat([shards[r][0] for r in range(self.world)])
        else:
            flat = self._allgather(group, shards[self.rank][0], total)
            per = [checksum(flat[slice(*shard_bounds(total, self.world, r))]) for r in range(self.world)]
            _expect(folded_digest(per, total), digest, f"reassembled state of step {step}")
            if out is not None:
                check_out(out, layout)
                copy_range_in(flat, layout, 0, total, out)
        tensors = dict(out) if out is not None else unflatten(flat, layout)
        return Restored(step, tensors, doc["meta"])

    def _verified_shard(self, rank: int, step: int) -> tuple[torch.Tensor, dict, int]:
        rec = get_json(self.store, self.keys.commit(step, rank))
        for attempt in (0, 1):
            slot = self._find_committed(rank, step)
            data = slot.payload()[: slot.get("length")]
            digest = checksum(data)
            if rec and digest == slot.get("checksum") == rec["checksum"]:
                return data, slot.doc(), digest
            if attempt == 0:  # corrupt in memory: the agents rebuild this node from parity
                self.rejected.append((rank, step))
                request_rebuild(self.store, self.run_id, [self.node], step=step,
                                timeout_s=self.timeout_s)
        raise errors.ChecksumMismatch(f"shard of rank {rank} step {step} fails its checksum "
                                      f"after a rebuild")

    def _check_files(self) -> None:
        d = Path(self.shm_dir) / self.run_id
        if not d.is_dir():
            raise errors.SnapshotNotFound(f"no snapshot directory {d}")
        for b in (0, 1):
            p = data_path(self.shm_dir, self.run_id, self.rank, b)
            if p.exists():
                self._header_checked(p)

    def _header_checked(self, p: Path) -> Header:
        """The header of slot file p (read, not mapped) if it is this run's data slot of this world."""
        h = read_header(p)
        if h.run_id != self.run_id or h.kind != Kind.DATA:
            raise errors.ForeignSnapshot(f"{p} belongs to run {h.run_id!r}, not {self.run_id!r}")
        if h.world != self.world:
            raise errors.WorldSizeMismatch(f"{p} was written by a world of {h.world} ranks, "
                                           f"this trainer has {self.world}")
        return h

    def _mapped(self, p: Path) -> SlotFile:
        """A mapping of slot file p, reused between restores while the file is the same."""
        st = p.stat()
        ident = (st.st_dev, st.st_ino, st.st_size)
        hit = self._maps.get(p)
        if hit is not None and hit[0] == ident:
            return hit[1]
        if hit is not None:
            hit[1].close()
        s = SlotFile.open(p)
        self._maps[p] = (ident, s)
        return s

    def _find_committed(self, rank: int, step: int) -> SlotFile:
        d = Path(self.shm_dir) / self.run_id
        for b in (0, 1):
            p = data_path(self.shm_dir, self.run_id, rank, b)
            if not p.exists():
                self._unmap(p)
                continue
            h = self._header_checked(p)
            if h.state == State.COMMITTED and h.step == step:
                s = self._mapped(p)
                if s.get("state") == State.COMMITTED and s.get("step") == step:
                    return s
        raise errors.SnapshotNotFound(f"rank {rank} holds no committed snapshot of step {step} "
                                      f"in {d}")

    def _unmap(self, p: Path) -> None:
        hit = self._maps.pop(p, None)
        if hit is not None:
            hit[1].close()

    def _allgather(self, group: dist.ProcessGroup, mine: torch.Tensor, total: int) -> torch.Tensor:
        if group.size() != self.world:
            raise errors.WorldSizeMismatch(f"restore group has {group.size()} ranks, snapshot "
                                           f"{self.world}")
        per = shard_bounds(total, self.world, 0)[1]  # padded shard length
        flat = torch.zeros(per * self.world, dtype=torch.uint8)
        send = torch.zeros(per, dtype=torch.uint8)
        send[: mine.numel()] = mine
        group.allgather([list(flat.split(per))], [send]).wait()
        return flat[:total]

    def _close_slots(self) -> None:
        for s in self._slots or []:
            s.close()
        self._slots = None

    def close(self) -> None:
        """Finish a pending copy and unmap the slots (files stay with the agent)."""
        self.wait()
        self._close_slots()
        for p in list(self._maps):
            self._unmap(p)


def _same(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> bool:
    if len(layout.specs) != len(tensors):
        return False
    return all(s.name == n and tuple(t.shape) == s.shape
               and str(t.dtype).removeprefix("torch.") == s.dtype
               for s, (n, t) in zip(layout.specs, tensors.items()))


def _expect(got: int, want: int, what: str) -> None:
    if got != want:
        raise errors.ChecksumMismatch(f"{what}: digest {got:#018x} != recorded {want:#018x}")


def _td(s: float):
    import datetime
    return datetime.timedelta(seconds=s)
