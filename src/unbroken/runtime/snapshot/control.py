"""The snapshot control plane on the coordinator's TCPStore, and the launcher's calls.

Owns: the agents' command queue and agent topology records on the store (their key names are
store/keys.py's `SnapshotKeys`), and the functions a launcher calls: `start_agent`, `stop_agent`, `request_rebuild`, `remove_run`. Does not own the bytes
(they move through /dev/shm files and gloo groups, never through the store).

Keys live under `unbroken/snap/<run_id>/`. Commands are appended by anyone (`cmd/n` counter, then
`cmd/<i>` JSON) and executed in order by every agent that was up when they were posted; each agent
answers `cmd/<i>/done/<node>` with "ok <step>" or "error <Type> <message>". An agent's record
`agent/<node>` names the first command it serves (`since`: a replacement skips older ones), and an
agent whose command fails sets `cmd/<i>/abandoned/<group's first node>`: either tells the group's
peers waiting on that command to give it up at once rather than after their timeout. A trainer that
skips its save of a step (its agent two copies behind) sets `incomplete/<step>` before the next step can
commit, and so does an agent whose parity encode of the step failed; the ranks' next save then
overwrites that step rather than the older one all still hold with its parity. With replica groups of
several ranks the mark goes into every shard index's family (`shard_run_id`).

The seal, in two phases: a family seals a step (`sealed/<step>`) once every node's agent encoded its
parity (each counts itself once: `pfirst/<step>/<node>`, `nsealed/<step>`), or, without parity, once
every rank committed it; a trainer overwrites its older slot only once its newer step is sealed in every
family (client.py). So a node lost at any moment, inside one family's encode while another's has
finished included, leaves a step sealed in every family, held with its parity by every survivor: a
rebuild (`rebuild_step`, then `request_rebuild` at that step in each family) and a restore load it.
"""

from __future__ import annotations

import datetime
import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from unbroken.runtime.store.keys import SnapshotKeys
from unbroken.runtime.store.client import connect, get_json

from . import errors
from .shm import check_run_id

DEFAULT_SHM_DIR = "/dev/shm/unbroken"


def shard_run_id(run_id: str, shard: int, shards: int) -> str:
    """The snapshot run id of shard index `shard` of replica groups of `shards` ranks.

    Rank j of every replica group holds the same state (its FSDP2 shards: parameters, optimizer state,
    RNG), so each shard index is a data-parallel state of its own, snapshotted by the same protocol as a
    one-rank run: its own slots, commit records and parity under this id. One-rank groups keep the run id."""
    return run_id if shards == 1 else f"{run_id}.s{shard}"


def shard_run_ids(run_id: str, shards: int) -> list[str]:
    """Every shard index's snapshot run id (see shard_run_id), in order."""
    return [shard_run_id(run_id, j, shards) for j in range(shards)]


def node_dir(shm_dir: str, node: int) -> str:
    """Node `node`'s emulated CPU memory under `shm_dir`: gone when the node is lost."""
    return f"{shm_dir}/node{node}"


@dataclass(frozen=True)
class Topology:
    """How trainer ranks and parity groups map onto nodes (one agent per node)."""

    nodes: int
    ranks_per_node: int  # trainer rank r lives on node r // ranks_per_node
    parity: str  # "none" | "xor" | "rs"
    k: int = 0  # data blocks per stripe; a parity group is k + m consecutive nodes
    m: int = 0

    def __post_init__(self) -> None:
        if self.parity not in ("none", "xor", "rs"):
            raise ValueError(f"parity must be none, xor or rs, not {self.parity!r}")
        if self.parity != "none":
            if self.k < 1 or self.m < 1 or (self.parity == "xor" and self.m != 1):
                raise ValueError(f"parity {self.parity} needs k >= 1 and m >= 1 (xor: m == 1)")
            if self.nodes % (self.k + self.m):
                raise ValueError(f"{self.nodes} nodes do not split into groups of k+m={self.k + self.m}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def group_size(self) -> int:
        return self.k + self.m if self.parity != "none" else 1

    def group_of(self, node: int) -> list[int]:
        g = node // self.group_size
        return list(range(g * self.group_size, (g + 1) * self.group_size))

    def ranks_of(self, node: int) -> list[int]:
        return [node * self.ranks_per_node + i for i in range(self.ranks_per_node)]


def snapshot_keys(run_id: str) -> SnapshotKeys:
    """Store key names for one run (see the module docstring); raises ValueError for a bad run id."""
    return SnapshotKeys(check_run_id(run_id))


def read_topology(store: dist.Store, run_id: str, node: int = 0, timeout_s: float = 60) -> Topology:
    """The topology published by node `node`'s agent; waits up to timeout_s for it."""
    key = snapshot_keys(run_id).agent(node)
    _wait_keys(store, [key], timeout_s, f"snapshot agent of node {node} never came up")
    rec = json.loads(store.get(key))
    return Topology(**rec["topology"])


def post_command(store: dist.Store, run_id: str, cmd: dict) -> int:
    keys = snapshot_keys(run_id)
    i = store.add(keys.cmd("n"), 1)
    store.set(keys.cmd(i), json.dumps(cmd))
    return i


def wait_command(store: dist.Store, run_id: str, i: int, nodes: list[int],
                 timeout_s: float) -> list[int]:
    """Wait for every node in `nodes` to answer command i; return their steps or raise the error
    type an agent reported (errors.Unrecoverable when one never answers)."""
    keys = snapshot_keys(run_id)
    want = [keys.cmd(i, "done", n) for n in nodes]
    _wait_keys(store, want, timeout_s, f"snapshot agents did not finish command {i}",
               errors.Unrecoverable)
    steps = []
    for n, key in zip(nodes, want):
        word, _, rest = store.get(key).decode().partition(" ")
        if word == "error":
            typ, _, msg = rest.partition(" ")
            raise getattr(errors, typ, errors.Unrecoverable)(f"node {n}: {msg}")
        steps.append(int(rest))
    return steps


def request_rebuild(store: dist.Store, run_id: str, lost: list[int], *, step: int | None = None,
                    timeout_s: float = 120) -> int:
    """Rebuild the snapshot data of the `lost` nodes from their parity groups; returns the step.

    Contract: replacement agents for lost nodes are running (`start_agent`, same node ids, empty
    or damaged /dev/shm) and no trainer is saving. With step=None the agents pick the newest step
    that every survivor holds with complete parity. Raises Unrecoverable when a group lost more
    than m nodes, when parity is off, or when no common step exists; the caller then falls back to
    the latest persistent checkpoint.
    """
    if not lost:
        raise ValueError("request_rebuild needs at least one lost node")
    topo = read_topology(store, run_id, lost[0], timeout_s)  # the replacement agent publishes it
    if topo.parity == "none":
        raise errors.Unrecoverable(f"nodes {lost} lost and the run keeps no parity")
    gs = topo.group_size
    groups = {g: [n for n in lost if n // gs == g] for g in {n // gs for n in lost}}
    for g, gl in groups.items():
        if len(gl) > topo.m:
            raise errors.Unrecoverable(f"parity group {g} lost nodes {gl}: more than m={topo.m} "
                                       f"({topo.parity} {topo.k}+{topo.m}) can rebuild")
    i = post_command(store, run_id, {"op": "rebuild", "lost": sorted(lost), "step": step})
    involved = sorted(n for g in groups for n in range(g * gs, (g + 1) * gs))
    return wait_command(store, run_id, i, involved, timeout_s)[0]


def rebuild_step(store: dist.Store, run_ids: list[str], survivors: list[int]) -> int | None:
    """The step to rebuild lost nodes at: the newest that every family in `run_ids` sealed and every
    survivor node publishes with parity (`parity/<node>`), or None. Call after the lost nodes' agents
    were replaced (no trainer saving); pass the result to request_rebuild in every family."""
    common: set[int] | None = None
    for run_id in run_ids:
        keys = snapshot_keys(run_id)
        for n in survivors:
            held = set(get_json(store, keys.parity(n), []))
            common = held if common is None else common & held
    sealed = [s for s in common or () if store.check([snapshot_keys(r).sealed(s) for r in run_ids])]
    return max(sealed, default=None)


@dataclass(frozen=True)
class AgentSpec:
    """Everything an agent process needs; `start_agent` turns it into a command line."""

    store: str  # host:port of the coordinator's TCPStore
    run_id: str
    node: int
    topology: Topology
    shm_dir: str = DEFAULT_SHM_DIR
    timeout_s: float = 60.0  # for collectives among agents
    shards: int = 1  # ranks per replica group: the agent serves each shard index's snapshots (shard_run_id)


def start_agent(spec: AgentSpec, *, ready_timeout_s: float = 60, log: Path | None = None,
                store: dist.Store | None = None, spawn: Callable | None = None) -> subprocess.Popen:
    """Spawn `python -m unbroken.runtime.snapshot.agent` for one node and wait until it serves.
    `spawn(argv, log)`, if given, starts that command line instead of `subprocess.Popen` and returns a
    handle with Popen's pid, poll, kill and wait (the local launcher's fork server: launcher/zygote.py).

    Start it before the trainers; it outlives them. Existing slot files of the run in shm_dir are
    adopted, so restarting an agent on a healthy node keeps its snapshots. With `spec.shards` > 1 the one
    process serves every shard index (a thread each) and is ready once each has published its record.
    """
    nonce = secrets.token_hex(8)
    t = spec.topology
    argv = [sys.executable, "-m", "unbroken.runtime.snapshot.agent", "--store", spec.store,
            "--run-id", spec.run_id, "--node", str(spec.node), "--nodes", str(t.nodes),
            "--ranks-per-node", str(t.ranks_per_node), "--parity", t.parity, "--k", str(t.k),
            "--m", str(t.m), "--shm-dir", spec.shm_dir, "--timeout", str(spec.timeout_s),
            "--nonce", nonce, "--shards", str(spec.shards)]
    if spawn is not None:
        proc = spawn(argv, log)
    else:
        out = open(log, "ab") if log else None
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None)
    own = store or connect(spec.store)
    ready = [snapshot_keys(r).agent(spec.node) for r in shard_run_ids(spec.run_id, spec.shards)]
    deadline = time.monotonic() + ready_timeout_s
    while any(get_json(own, key, {}).get("nonce") != nonce for key in ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"snapshot agent for node {spec.node} did not start (rc={proc.poll()})")
        time.sleep(0.02)
    return proc


def stop_agent(proc: subprocess.Popen, timeout_s: float = 10) -> int:
    """SIGTERM the agent and wait; its /dev/shm files stay (call remove_run at the end of a run)."""
    proc.terminate()
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def remove_run(shm_dir: str, run_id: str, shards: int = 1) -> None:
    """Delete a run's snapshot files on this node, every shard index's (end of run, a node wiped)."""
    for r in shard_run_ids(check_run_id(run_id), shards):
        shutil.rmtree(Path(shm_dir) / r, ignore_errors=True)


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float, what: str,
               exc: type[Exception] = RuntimeError) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the store raises DistStoreError / RuntimeError
        raise exc(f"{what} within {timeout_s:g} s ({type(e).__name__})") from None


def topology_dict(t: Topology) -> dict:
    return asdict(t)
