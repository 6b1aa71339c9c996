"""A replica's whole training state as one flat dict of named tensors, and back.

Owns: naming (params by module path, optimizer state by its parameter's path and key, torch's RNG state),
creating optimizer state before a restore (a fresh optimizer has none), and loading tensors in place.
Does not own: where the bytes go (snapshot/ for CPU memory, checkpoint.py for DCP on disk).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Views (no copies) of every tensor that defines the run's future, in a fixed order.

    The snapshot copies them while the next step computes: the caller must not let the optimizer
    modify them before the copy finished (SnapshotClient.wait before optimizer.step)."""
    out: dict[str, torch.Tensor] = {}
    names = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.data
        names[id(p)] = name
    # Optimizer state by its parameter's name, not its index in the optimizer: a pipeline stage's
    # parameter 0 is another stage's parameter 0 too, and DCP keeps one copy of equal keys across ranks
    for p, st in optimizer.state.items():
        for key, value in sorted(st.items()):
            if torch.is_tensor(value):
                out[f"optim/{names[id(p)]}/{key}"] = value if value.dim() else value.view(1)
    out["rng/torch"] = torch.get_rng_state()
    return out


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """training_state with every DTensor (FSDP2 inside a replica group) replaced by this rank's local
    shard, a view of it: what rank j holds, identical on rank j of every group, for in-memory snapshots
    whose bytes are this rank's alone. DCP takes training_state itself (it reshards DTensors)."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in training_state(model, optimizer).items()}


def materialize(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (shapes and dtypes) without changing the parameters:
    one step on zero gradients, then the parameters are put back. Call once before loading state."""
    if optimizer.state:
        return
    saved = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)


def load_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["rng/torch"].contiguous())
