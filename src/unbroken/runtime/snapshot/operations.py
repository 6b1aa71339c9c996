"""Operations the agents run together (the queue's commands): encode parity for a step, rebuild lost nodes' snapshots.

Owns the agent side of each command: gathering its inputs from slot files and the store, a ready
barrier (so one member's missing input fails the command everywhere instead of hanging the others
in a collective), a fresh gloo group per command on its own store prefix (`Rendezvous`: given up as
soon as the command is), and writing results into slot files. Does not own the stripe math
(parity.py) or the queue (control.py, agent.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from . import errors
from .checksum import checksum
from unbroken.runtime.store.client import get_json
from .erasure import RSCodec, gloo_group
from .layout import shard_bounds
from .parity import Member, StripePlan, encode, rebuild
from .shm import Kind, SlotFile, State, data_path, parity_path



class SnapshotAgent(Protocol):
    """What an operation needs of the agent that runs it (agent.SnapshotAgent has it): a protocol rather
    than an import, since the agent imports this module."""
    store: object
    keys: object
    run_id: str
    node: int
    topo: object
    shm_dir: str
    timeout_s: float
    ranks: list[int]
    data: dict[int, list[SlotFile | None]]
    parity: dict[int, list[SlotFile | None]]
    rendezvous: Rendezvous

    def find(self, slots: list[SlotFile | None], step: int) -> SlotFile | None: ...

    def writable(self, slots: list[SlotFile | None], path_of: Callable[[int], Path], capacity: int, rank: int,
                 kind: Kind, keep_step: int | None = None, spare: int | None = None) -> SlotFile: ...

    def publish(self) -> None: ...

    def sealed(self, step: int) -> bool: ...

    def seal(self, step: int) -> None: ...

T = TypeVar("T")
BARRIER_POLL_S = 0.02  # store round trips while waiting for peer agents (commands take 0.1-1 s)


class Rendezvous:
    """Forms each command's gloo group on a thread and a store client of its own, while the agent's
    thread watches whether the command was given up (`_given_up`), and leaves at once if so.

    Why: the ready barrier proves that every member was up a moment ago, not that it reaches the
    rendezvous. A node lost in between (a `node` fault fires on the very step record whose snapshot
    the agents are then encoding: the barrier's last poller is killed after its peers saw it ready)
    held its peers in gloo's rendezvous and connectFullMesh, in C++ and deaf to `abandoned` or to the
    node's replacement, for the whole collective timeout, and the rebuild of that node waited behind
    it. Leaving the formation to end on its own timeout is harmless: it writes no slot, and its store
    client is not the agent's (a client blocked in a wait would hold the agent's own calls)."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect
        self._store: dist.Store | None = None  # reused while formations finish (an etcd client is never freed)

    def form(self, prefix: str, rank: int, size: int, timeout_s: float,
             given_up: Callable[[], str | None]) -> dist.ProcessGroup:
        """The gloo group of `size` members on `prefix`; raises errors.Unrecoverable once `given_up()`
        says why the command can no longer complete, or what gloo raised (its timeout: `timeout_s`)."""
        store = self._store or self._connect()
        self._store = None  # an abandoned formation may block in it: the next command takes a new one
        pg = watched(lambda: gloo_group(store, prefix, rank, size, timeout_s), given_up, "agent-rendezvous")
        self._store = store
        return pg


def watched(work: Callable[[], T], given_up: Callable[[], str | None], name: str) -> T:
    """`work()` run on a daemon thread while this thread polls `given_up()` every BARRIER_POLL_S; returns
    what it returned or raises what it raised, or errors.Unrecoverable(why) at once when given_up says
    why. A given-up `work` is left to end on gloo's own timeout (a blocked gloo op cannot be cancelled:
    ProcessGroupGloo.abort and shutdown, tried on torch 2.13, left a recv from a silent peer blocked until
    that peer exited), so `work` must write nothing another command could read: private buffers only."""
    got: list = []
    done = threading.Event()

    def run() -> None:
        try:
            got.append(work())
        except Exception as e:  # noqa: BLE001 - raised by the agent's thread below
            got.append(e)
        done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    while not done.wait(BARRIER_POLL_S):
        why = given_up()
        if why is not None:
            raise errors.Unrecoverable(why)
    if isinstance(got[0], Exception):
        raise got[0]
    return got[0]


def _group(a: SnapshotAgent, i: int, members: list[int], j: int, size: int) -> dist.ProcessGroup:
    """Command i's gloo group (member j of `size`), given up once a peer's agent was replaced after i
    was posted or a member abandoned i: any peer may be the one that never arrives."""
    peers = [n for n in members if n != a.node]
    return a.rendezvous.form(a.keys.cmd(i, "pg"), j, size, a.timeout_s, lambda: _given_up(a, i, members, peers))


def run(agent: SnapshotAgent, i: int, cmd: dict) -> int:
    """Execute command i; returns the step it acted on (-1: this node's group is not involved)."""
    if cmd["op"] == "parity":
        return _parity(agent, i, cmd["step"])
    if cmd["op"] == "rebuild":
        return _rebuild(agent, i, cmd["lost"], cmd.get("step"))
    raise ValueError(f"unknown snapshot command {cmd['op']!r}")


def _barrier(a: SnapshotAgent, i: int, members: list[int], name: str, value: str) -> list[str]:
    """Post `value` for this node and wait for every member's; returns them in member order.

    Raises errors.Unrecoverable after a.timeout_s, or at once when the command was abandoned by a
    member of the group or a missing member's agent was replaced after the command was posted (a
    replacement serves only newer commands): a dead peer costs one timeout, not one per queued
    command. Polls with check() rather than a timed wait(), whose timeout leaves a stale waiter on
    the server that can answer a later request on this client."""
    a.store.set(a.keys.cmd(i, name, a.node), value)
    keys = [a.keys.cmd(i, name, n) for n in members]
    deadline = time.monotonic() + a.timeout_s
    while missing := [n for n, k in zip(members, keys) if not a.store.check([k])]:
        why = _given_up(a, i, members, missing)
        if why is None and time.monotonic() > deadline:
            why = f"peer agents of nodes {missing} did not answer within {a.timeout_s:g} s"
        if why is not None:
            raise errors.Unrecoverable(why)
        time.sleep(BARRIER_POLL_S)
    return [a.store.get(k).decode() for k in keys]


def _given_up(a: SnapshotAgent, i: int, members: list[int], missing: list[int]) -> str | None:
    """Why command i can no longer complete in this group, or None while it still may."""
    key = a.keys.cmd(i, "abandoned", members[0])
    if a.store.check([key]):
        return a.store.get(key).decode()
    for n in missing:
        since = get_json(a.store, a.keys.agent(n), {}).get("since", 0)
        if since > i:
            return f"node {n}'s agent was replaced after command {i} was posted"
    return None


def abandon(a: SnapshotAgent, i: int, why: str) -> None:
    """Tell the group's peers still waiting at a barrier of command i that it will not complete."""
    members = a.topo.group_of(a.node)
    a.store.set(a.keys.cmd(i, "abandoned", members[0]), f"node {a.node} gave up: {why}")


def _ready(a: SnapshotAgent, i: int, members: list[int], err: Exception | None) -> None:
    vals = _barrier(a, i, members, "ready", "ok" if err is None else f"{type(err).__name__} {err}")
    bad = [f"node {n}: {v}" for n, v in zip(members, vals) if v != "ok"]
    if err is not None:
        raise err
    if bad:
        raise errors.Unrecoverable("; ".join(bad))


def _setup(a: SnapshotAgent):
    t = a.topo
    members = t.group_of(a.node)
    codec = RSCodec(t.k, t.m) if t.parity == "rs" else None
    return members, members.index(a.node), StripePlan(t.k, t.m), codec


def _parity(a: SnapshotAgent, i: int, step: int) -> int:
    members, j, plan, codec = _setup(a)
    P = a.topo.ranks_per_node
    err, shards, manifest = None, {}, {}
    try:
        ranks = [r for n in members for r in a.topo.ranks_of(n)]
        recs = {r: json.loads(a.store.get(a.keys.commit(step, r))) for r in ranks}
        for layer, r in enumerate(a.ranks):
            s = a.find(a.data[r], step)
            if s is None:
                raise errors.SnapshotNotFound(f"rank {r} holds no committed step {step}")
            shards[layer] = s
        doc = shards[0].doc()
        manifest = {"step": step, "records": recs, "digest": int(a.store.get(a.keys.digest(step))),
                    "doc": {"layout": doc["layout"], "meta": doc["meta"]},
                    "c": plan.chunk_bytes(max(r["length"] for r in recs.values()))}
    except Exception as e:  # noqa: BLE001 - reported through the ready barrier
        err = e
    _ready(a, i, members, err)
    c = manifest["c"]
    pg = _group(a, i, members, j, plan.size)
    peers = [n for n in members if n != a.node]
    for layer in range(P):
        ps = a.writable(a.parity[layer], lambda b, l=layer: parity_path(a.shm_dir, a.run_id, l, b),
                        plan.m * c, layer, Kind.PARITY, spare=_kept(a, a.parity[layer]))
        ps.set(state=int(State.WRITING))
        ps.set(step=step, length=plan.m * c, gen=ps.get("gen") + 1)
        _fault_hold(a, i, step)
        shard = shards[layer].payload()[: shards[layer].get("length")]
        # encoded into a private buffer, watched: a node lost mid-encode held this family's agent in a gloo
        # recv for the whole collective timeout (15 s), and the rebuild of that node queued behind it (CI,
        # e1305ff: rebuilt after 12.9 s); given up, the encode may still write its buffer, never the slot
        parity = torch.zeros(plan.m * c, dtype=torch.uint8)
        watched(lambda: encode(pg, Member(plan, j, c, shard, parity, codec), layer * 1000),
                lambda: _given_up(a, i, members, peers), "agent-encode")
        ps.payload()[: plan.m * c] = parity
        ps.set_doc(manifest)
        ps.set(state=int(State.COMMITTED))
    a.seal(step)  # before publishing: a step listed with parity by every node is sealed
    a.publish()
    return step


def _kept(a: SnapshotAgent, slots: list[SlotFile | None]) -> int | None:
    """The step whose parity slot an encode must not overwrite: the newest held that is sealed in every
    family. The trainers keep its data until a newer step is sealed everywhere (client._pick_slot), so a
    node lost in this encode, or in any family's, leaves that step to be rebuilt from."""
    held = sorted((s.get("step") for s in slots if s and s.get("state") == State.COMMITTED), reverse=True)
    return next((step for step in held if a.sealed(step)), None)


def _fault_hold(a: SnapshotAgent, i: int, step: int) -> None:
    """A `node:...,phase=parity` fault (launcher/chaos.py): when the store names this node and a step at
    or below `step`, say so (`holding/<node>` = step) and stay inside this encode, the parity slot torn and
    the peers blocked in its collective, until the launcher loses the node. Once per agent and run."""
    key = a.keys.hold(a.node)
    if not a.store.check([key]) or int(a.store.get(key)) > step or a.store.check([a.keys.holding(a.node)]):
        return
    a.store.set(a.keys.holding(a.node), str(step))
    deadline = time.monotonic() + 4 * a.timeout_s
    while time.monotonic() < deadline:  # the node is lost (SIGKILL) long before
        time.sleep(0.05)
    raise errors.Unrecoverable(f"command {i}: held by a parity fault and the node was never lost")


def held_with_parity(a: SnapshotAgent) -> set[int]:
    """The steps whose data of every local rank and parity this agent holds committed (what it serves a
    rebuild from)."""
    return _avail(a)


def _avail(a: SnapshotAgent) -> set[int]:
    """Steps this node can serve a rebuild from: data of every local rank and parity, committed."""
    sets = [{s.get("step") for s in sl if s and s.get("state") == State.COMMITTED}
            for sl in [*a.data.values(), *a.parity.values()]]
    return set.intersection(*sets)


def _rebuild(a: SnapshotAgent, i: int, lost: list[int], step: int | None) -> int:
    members, j, plan, codec = _setup(a)
    if not set(lost) & set(members):
        return -1
    lost_j = sorted(members.index(n) for n in lost if n in members)
    me_lost = a.node in lost
    avails = _barrier(a, i, members, "avail", json.dumps([] if me_lost else sorted(_avail(a))))
    common = set.intersection(*(set(json.loads(v)) for n, v in zip(members, avails) if n not in lost))
    if step is None:
        step = max(common, default=None)
        if step is None:
            raise errors.Unrecoverable(f"no step has data and parity on every survivor of {members}")
    err = None if step in common else errors.Unrecoverable(
        f"step {step} is not held with parity by every survivor of group {members}")
    helper = next(n for n in members if n not in lost)
    if a.node == helper and err is None:
        a.store.set(a.keys.cmd(i, "manifest"), json.dumps(a.find(a.parity[0], step).doc()))
    _ready(a, i, members, err)
    manifest = json.loads(a.store.get(a.keys.cmd(i, "manifest")))
    c = manifest["c"]
    pg = _group(a, i, members, j, plan.size)
    failures = []
    for layer, rank in enumerate(a.ranks):
        if me_lost:
            shard, par, out = None, torch.zeros(plan.m * c, dtype=torch.uint8), torch.empty(plan.k * c, dtype=torch.uint8)
        else:
            ds, ps = a.find(a.data[rank], step), a.find(a.parity[layer], step)
            shard, par, out = ds.payload()[: ds.get("length")], ps.payload()[: plan.m * c], None
        # watched as the encode is; a lost node rebuilds into private buffers (par, out), survivors only read
        watched(lambda: rebuild(pg, Member(plan, j, c, shard, par, codec), lost_j, out, layer * 1000),
                lambda: _given_up(a, i, members, [n for n in members if n != a.node]), "agent-rebuild")
        if me_lost:  # keep going on a bad layer: peers are still in the collective for the rest
            try:
                _install(a, step, layer, rank, manifest, out, par)
            except errors.StateLoadError as e:
                failures.append(e)
    a.publish()
    if failures:
        raise failures[0]
    return step


def _install(a: SnapshotAgent, step: int, layer: int, rank: int, manifest: dict,
             out: torch.Tensor, par: torch.Tensor) -> None:
    """Verify a rebuilt shard against its recorded checksum, then commit it and its parity."""
    rec = manifest["records"][str(rank)]
    data = out[: rec["length"]]
    if checksum(data) != rec["checksum"]:
        raise errors.ChecksumMismatch(f"rebuilt shard of rank {rank} step {step} fails its "
                                      f"checksum (parity or survivors damaged)")
    lo, hi = shard_bounds(rec["total"], a.topo.world, rank)
    ds = a.writable(a.data[rank], lambda b: data_path(a.shm_dir, a.run_id, rank, b),
                    rec["length"], rank, Kind.DATA, keep_step=step)
    ds.set(state=int(State.WRITING))
    ds.payload()[: rec["length"]] = data
    ds.set_doc({**manifest["doc"], "offset": lo, "total": rec["total"], "world": a.topo.world})
    ds.set(step=step, length=rec["length"], checksum=rec["checksum"], gen=ds.get("gen") + 1)
    ds.set(state=int(State.COMMITTED))
    ps = a.writable(a.parity[layer], lambda b: parity_path(a.shm_dir, a.run_id, layer, b),
                    par.numel(), layer, Kind.PARITY, keep_step=step)
    ps.set(state=int(State.WRITING))
    ps.payload()[: par.numel()] = par
    ps.set_doc(manifest)
    ps.set(step=step, length=par.numel(), gen=ps.get("gen") + 1)
    ps.set(state=int(State.COMMITTED))
