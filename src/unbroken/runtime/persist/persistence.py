"""A trainer's snapshots and checkpoints: save hooks around the optimizer step, and resume.

Owns: when to snapshot (every `snapshot.every` committed steps, each live replica writing the shares
`policy.snapshotting.shares_of` gives it, adopted shares of dead replicas included; in replica groups,
rank j snapshots its own FSDP2 shards into shard index j's family, shared across the groups), when to write a
DCP checkpoint (every `checkpoint.every` steps and the last, by the lowest live replica: data-parallel replicas hold
identical state, so one copy suffices), and resuming a restarted trainer from the agents' memory or the
latest checkpoint, verified before the first step. Does not own: slots, parity, agents (snapshot/),
DCP's format (checkpoint.py), or deciding to restart (the launcher).
"""
from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import PrefixStore, Store

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.policy.snapshotting import shares_of
from unbroken.runtime.store import keys
from unbroken.runtime.persist.checkpoint import Checkpointer, latest_checkpoint
from unbroken.runtime.parallel.accumulator import param_digest, unique_parameters
from unbroken.runtime.snapshot import SnapshotClient, StateLoadError
from unbroken.runtime.snapshot.control import node_dir, shard_run_id, shard_run_ids
from unbroken.runtime.persist.state import load_rng, local_state, materialize, training_state


class Persistence:
    def __init__(self, cfg: Config, me: int, store: Store, run_id: str, run_dir: Path,
                 model: nn.Module, optimizer: torch.optim.Optimizer, log: EventLog, rank: int = 0):
        self.cfg, self.me, self.store, self.run_id, self.log = cfg, me, store, run_id, log
        self.tag = {"rank": rank} if cfg.parallel.group_size > 1 else {}  # a group's rank: its shard's digest
        self.rank = rank
        self.model, self.optimizer = model, optimizer
        self.world = cfg.run.replicas
        self.clients: dict[int, SnapshotClient] = {}
        self.ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
        # A replica group of G ranks saves its FSDP2 shards together (DCP over the group's ranks) on a
        # process group of its own: DCP's async save runs collectives on its thread, which must not
        # interleave with FSDP's on the main thread's group. One-rank groups save single-process.
        G = cfg.parallel.group_size
        pg = dist.new_group(backend="gloo") if cfg.checkpoint.every and G > 1 else None
        self.ckpt = (Checkpointer(self.ckpt_dir, run_id=run_id, world=G, every=cfg.checkpoint.every,
                                  process_group=pg) if cfg.checkpoint.every else None)

    def _client(self, share: int) -> SnapshotClient:
        if share not in self.clients:
            G = self.cfg.parallel.group_size
            run_id, others = shard_run_id(self.run_id, self.rank, G), shard_run_ids(self.run_id, G)
            shm_dir = node_dir(self.cfg.snapshot.shm_dir, self.cfg.topology().node_of(share))
            self.clients[share] = SnapshotClient(self.store, run_id=run_id, rank=share, world=self.world,
                                                 shm_dir=shm_dir, siblings=tuple(r for r in others if r != run_id))
        return self.clients[share]

    def before_optimizer(self) -> None:
        """Call right before optimizer.step(): the previous snapshot's copy must have left the tensors."""
        for c in self.clients.values():
            c.wait()

    def after_commit(self, step: int, members: tuple[int, ...], on_snapshot=None) -> None:
        """Call once per committed step, after the optimizer step. Starts the copies and returns."""
        due_snap = self.cfg.snapshot.enabled and step % self.cfg.snapshot.every == 0
        # the last step too, as torchtitan saves it: what `unbroken export` and a continued run start from
        due_ckpt = (self.ckpt is not None and self.me == min(members)
                    and (step % self.cfg.checkpoint.every == 0 or step == self.cfg.run.steps - 1))
        if not (due_snap or due_ckpt):
            return
        if due_snap:
            tensors = local_state(self.model, self.optimizer)
            # the copies wait for `on_snapshot` (a fault point: a `tear` kills us there, mid-copy)
            gate = threading.Event() if on_snapshot is not None else None
            for share in shares_of(self.me, members, self.world):
                # a snapshot system that falls behind must never stall training: skip, keep the older;
                # so must a lost node's agent, for the shares adopted from its replicas (share != me)
                if self._client(share).save_async(step, tensors, {"step": step, "next_step": step + 1},
                                                  skip_if_busy=True, gate=gate,
                                                  skip_until_allocated=share != self.me):
                    self.log.emit("snapshot", replica=self.me, share=share, step=step)  # copy started
                else:
                    self.log.emit("snapshot_skipped", replica=self.me, share=share, step=step)
            if on_snapshot is not None:
                try:
                    on_snapshot()
                finally:
                    gate.set()
        if due_ckpt:
            self.ckpt.save_async(step, training_state(self.model, self.optimizer))  # DCP stages a copy

    def resume(self, source: str, generation: int, newest: int | None = None) -> int:
        """Load the state a restarted job continues from; returns the first step to run.

        `source` "memory" tries the agents (a collective over all replicas: every one must call it) and
        falls back to disk on any StateLoadError; "disk" loads the latest checkpoint; with neither, the
        run starts over from step 0 (what a checkpoint-and-restart job does before its first checkpoint).
        `newest`: the newest step a memory restore may load (the log's last recorded step), or None.
        """
        t0 = time.perf_counter()
        materialize(self.model, self.optimizer)
        tensors = training_state(self.model, self.optimizer)
        if source == "memory" and self.cfg.snapshot.enabled:
            # rank j of every group restores shard index j's family over a group of its own
            group = dist.ProcessGroupGloo(PrefixStore(keys.restore_prefix(generation, self.rank), self.store),
                                          self.me, self.world, datetime.timedelta(seconds=120))
            mine = local_state(self.model, self.optimizer)
            step = self._restore_memory(group, mine, newest)
            if step is not None:
                load_rng(mine)
                return self._restored("memory", step, t0)
        step = self._latest_checkpoint()
        if step is None:
            # from step 0 exactly as a fresh run: materialize() gave the optimizer a step of state
            self.optimizer.state.clear()
            self.log.emit("restored", replica=self.me, source="scratch", step=-1, seconds=0.0, **self.tag)
            return 0
        self.ckpt.load(tensors, step=step)
        load_rng(tensors)
        return self._restored("disk", step, t0)

    def _restore_memory(self, group: dist.ProcessGroup, tensors: dict[str, torch.Tensor],
                        limit: int | None = None) -> int | None:
        """Every replica agrees on each decision, so nobody is left alone in a collective: the newest
        step all hold (MIN), then whether every replica's own shard verifies (a corrupt shard is
        repaired from parity by the agents first); if not, all try the step held before it together."""
        client = self._client(self.me)
        held, everything = self._held(client, limit)
        step = _agree(group, max(held, default=-1))
        if step < 0:  # say why memory gave nothing: what the agents hold, against the log's last record
            self.log.emit("restore_failed", replica=self.me, source="memory",
                          error=f"no step held by every rank at or below {limit}: held {everything}")
        for _ in range(2):  # the agents hold two steps
            if step < 0:
                break
            try:
                client._verified_shard(self.me, step)  # checksum, and rebuild from parity if it fails
                ok = 1
            except StateLoadError as e:
                self.log.emit("restore_failed", replica=self.me, source="memory", step=step, error=str(e))
                ok = 0
            for _, bad in client.rejected:  # the shard read failed its checksum: repaired, or refused
                self.log.emit("shard_rejected", replica=self.me, step=bad, rebuilt=bool(ok))
            client.rejected.clear()
            if _agree(group, ok):
                try:
                    return client.restore(step=step, group=group, out=tensors).step
                except StateLoadError as e:  # whole-state digest: every rank sees the same result
                    self.log.emit("restore_failed", replica=self.me, source="memory", step=step, error=str(e))
            step = _agree(group, max((s for s in held if s < step), default=-1))
        return None

    def _held(self, client, limit: int | None) -> tuple[list[int], list[int]]:
        """(the steps every rank holds at or below `limit`, all it holds); ([], []) when the agents
        cannot say (logged)."""
        try:
            everything = client.committed_steps()
        except StateLoadError as e:
            self.log.emit("restore_failed", replica=self.me, source="memory", error=str(e))
            return [], []
        # no step whose record the log lacks (the launcher's `recorded`)
        return [s for s in everything if limit is None or s <= limit], everything

    def _latest_checkpoint(self) -> int | None:
        if self.ckpt is None or not self.ckpt_dir.is_dir():
            return None
        return latest_checkpoint(self.ckpt_dir, self.run_id)

    def _restored(self, source: str, step: int, t0: float) -> int:
        # the digest of what was loaded: equal to the failure-free run's step record of `step`
        self.log.emit("restored", replica=self.me, source=source, step=step,
                      seconds=round(time.perf_counter() - t0, 4),
                      param_digest=param_digest(unique_parameters(self.model)), **self.tag)
        return step + 1

    def close(self) -> None:
        """Call after the last step: waits for pending copies and the last checkpoint."""
        for c in self.clients.values():
            c.wait()
        if self.ckpt is not None:
            self.ckpt.wait()


def _agree(group: dist.ProcessGroup, value: int) -> int:
    """The minimum of `value` over every trainer rank: one answer every rank acts on. `group` joins rank j
    of every replica group; in groups of several ranks a second MIN over the group's own world (the
    default process group, idle while a restore runs) makes it the minimum over the whole grid, so every
    shard index loads the same step or none does."""
    t = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
