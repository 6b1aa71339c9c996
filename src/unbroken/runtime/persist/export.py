"""A run's parameters read back whole from one of its DCP checkpoints, in one process, for export.

Owns: finding the checkpoint to export (a step, else the newest complete one of the run) and reading every
`param/NAME` tensor of it whole, whatever layout saved it (DCP reshards FSDP2's and TP's DTensors; a
pipeline's stages wrote disjoint names into one checkpoint). Does not own: the checkpoints' layout
(checkpoint.py), or what the tensors become (model/hfweights.py).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from unbroken.runtime.persist.checkpoint import MARKER, step_dir

PARAM = "param/"


def complete_steps(directory: str | Path, run_id: str | None) -> list[int]:
    """The steps with a complete checkpoint (marker written) in `directory`, of run `run_id` when given."""
    d = Path(directory)
    found = []
    for marker in d.glob(f"step_*/{MARKER}") if d.is_dir() else ():
        rec = json.loads(marker.read_text())
        if run_id is None or rec.get("run_id") == run_id:
            found.append(int(rec["step"]))
    return sorted(found)


def read_params(directory: str | Path, run_id: str | None, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, {parameter name: whole tensor}) of checkpoint `step` (None: the newest) of run `run_id` in
    `directory`. Raises ValueError (one line) where that checkpoint is not there or complete."""
    steps = complete_steps(directory, run_id)
    if not steps:
        raise ValueError(f"no complete checkpoint in {str(directory)!r}: train with --checkpoint.every=N "
                         f"(the last step is always saved)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"--step {step}: no complete checkpoint of that step in {str(directory)!r} "
                         f"(there are: {', '.join(map(str, steps))})")
    path = step_dir(directory, step)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if k.startswith(PARAM) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # single-process DCP is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return step, {k[len(PARAM):]: v for k, v in state.items()}
