"""Persistent checkpoints with torch.distributed.checkpoint (DCP): async save every T steps,
discovery of the latest complete checkpoint, and checked loading.

Owns the on-disk layout (`<dir>/step_<NNNNNNNN>/` holding DCP's files plus `unbroken.json`, written
only after DCP finished, so a torn checkpoint is never discovered) and the typed errors for a
missing, foreign or differently sized checkpoint. Does not own what goes into the state dict (the
trainer's model/optimizer state, DCP-compatible) nor in-memory snapshots (runtime/snapshot/).
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unbroken.runtime.snapshot.errors import CheckpointNotFound, ForeignCheckpoint, WorldSizeMismatch

MARKER = "unbroken.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def latest_checkpoint(directory: str | Path, run_id: str) -> int | None:
    """Newest step with a complete checkpoint of `run_id` in `directory`, or None if it has none.

    Raises CheckpointNotFound if `directory` does not exist, ForeignCheckpoint if it only holds
    complete checkpoints of another run.
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {d} does not exist")
    ours, foreign = [], set()
    for sub in d.iterdir():
        m = _STEP_DIR.match(sub.name)
        marker = sub / MARKER
        if not m or not marker.is_file():
            continue  # not a checkpoint, or one whose save never finished
        rec = json.loads(marker.read_text())
        (ours.append(int(m.group(1))) if rec.get("run_id") == run_id else foreign.add(rec.get("run_id")))
    if not ours and foreign:
        raise ForeignCheckpoint(f"{d} holds checkpoints of run(s) {sorted(foreign)}, not {run_id!r}")
    return max(ours, default=None)


class Checkpointer:
    """DCP checkpoints of one run. Every rank of `process_group` makes the same calls (DCP's save
    and load are collectives); with no group and no default group, DCP runs single-process."""

    def __init__(self, directory: str | Path, *, run_id: str, world: int, every: int,
                 process_group: dist.ProcessGroup | None = None) -> None:
        if every < 1:
            raise ValueError("checkpoint interval `every` must be >= 1 step")
        self.directory, self.run_id, self.world, self.every = Path(directory), run_id, world, every
        self.pg = process_group
        self._pending: tuple[Future, Path, int] | None = None
        self._rank = process_group.rank() if process_group is not None else (
            dist.get_rank() if dist.is_initialized() else 0)

    @property
    def _no_dist(self) -> bool:
        return self.pg is None and not dist.is_initialized()

    def maybe_save(self, step: int, state_dict: Mapping[str, Any]) -> bool:
        """Call once per committed step: starts an async save when step % every == 0.

        DCP stages a copy before returning, so the caller may modify the tensors right after."""
        if step % self.every:
            return False
        self.save_async(step, state_dict)
        return True

    def save_async(self, step: int, state_dict: Mapping[str, Any]) -> None:
        """Start writing `state_dict` for `step`; waits for the previous save first."""
        self.wait()
        path = step_dir(self.directory, step)
        path.mkdir(parents=True, exist_ok=True)
        _quiet(self._no_dist)
        resp = dcp.async_save(dict(state_dict), checkpoint_id=str(path),
                              process_group=self.pg, no_dist=self._no_dist)
        fut = getattr(resp, "upload_completion", resp)
        if self._rank == 0:  # mark as soon as DCP is done, even if nobody calls wait()
            fut.add_done_callback(lambda f: f.exception() is None and self._mark(path, step))
        self._pending = (fut, path, step)

    def wait(self) -> None:
        """Block until the pending save (if any) is on disk and marked complete."""
        if self._pending is not None:
            (fut, path, step), self._pending = self._pending, None
            fut.result()
            if self._rank == 0:  # waiters may wake before done-callbacks run: mark here too
                self._mark(path, step)

    def _mark(self, path: Path, step: int) -> None:
        tmp = path / f"{MARKER}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps({"run_id": self.run_id, "step": step, "world": self.world}))
        os.replace(tmp, path / MARKER)  # the checkpoint is discoverable only once whole

    def latest(self) -> int | None:
        return latest_checkpoint(self.directory, self.run_id)

    def load(self, state_dict: Mapping[str, Any], step: int | None = None) -> int:
        """Load checkpoint `step` (default: latest) into `state_dict`'s tensors in place; returns
        the step. Raises CheckpointNotFound / ForeignCheckpoint / WorldSizeMismatch before
        touching any tensor."""
        step = self.latest() if step is None else step
        if step is None:
            raise CheckpointNotFound(f"no complete checkpoint of run {self.run_id!r} in {self.directory}")
        path = step_dir(self.directory, step)
        if not (path / MARKER).is_file():
            raise CheckpointNotFound(f"no complete checkpoint for step {step} in {self.directory}")
        rec = json.loads((path / MARKER).read_text())
        if rec["run_id"] != self.run_id:
            raise ForeignCheckpoint(f"{path} belongs to run {rec['run_id']!r}, not {self.run_id!r}")
        if rec["world"] != self.world:
            raise WorldSizeMismatch(f"{path} was saved by {rec['world']} ranks, this run has "
                                    f"{self.world}")
        _quiet(self._no_dist)
        dcp.load(dict(state_dict), checkpoint_id=str(path), process_group=self.pg,
                 no_dist=self._no_dist)
        return step


def _quiet(no_dist: bool) -> None:
    # Single-process DCP is intended here; its "assuming single process" warning is noise. An async save
    # warns again from DCP's writer thread after the call returned, so the filter is the process's (this
    # one message only; installing it again replaces it), not a block's.
    if no_dist:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
