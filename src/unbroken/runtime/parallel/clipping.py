"""The global norm of a gradient spread over a replica group's ranks, and clipping it.

Owns: summing a group's squared gradient over its ranks so that every element counts once (FSDP2 shards
are disjoint; a tensor that TP replicates counts on its mesh coordinate 0 only; a weight tied across
pipeline stages counts on the first stage, whose copy holds the same sum as the others'), and scaling every
rank's gradients by the one coefficient. Does not own: a gradient held whole by one process
(model/optim.clip_whole, torch's own clip_grad_norm_) or when to clip (the trainer).

The sum of squares is taken in float64 on each rank in parameter order and all-reduced over the group's
process group, so the norm, and the clipped gradient, are the same bits on every rank and on every run of
the same layout (the group's reduction order is fixed by its ranks).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: the coefficient is max_norm / (norm + EPS), at most 1


def counted_here(grad: torch.Tensor) -> bool:
    """Whether this rank counts `grad`'s local tensor: always for a plain tensor; for a DTensor, only on
    coordinate 0 of every mesh dimension it is replicated over (its shards count everywhere)."""
    if not isinstance(grad, DTensor):
        return True
    coordinate = grad.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, pl in zip(coordinate, grad.placements) if pl.is_replicate())


def clip_group(params: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup,
               skip: Callable[[torch.Tensor], bool] = lambda p: False) -> float:
    """Clip the gradients of a group's parameters to a global 2-norm of `max_norm`; returns the norm
    before clipping, the same on every rank. Call on every rank of the group at once (a collective), after
    the reduced gradient is in `.grad`. `skip(p)`: a parameter this rank must not count (a tied copy off
    the first stage); it is scaled all the same."""
    locals_: list[torch.Tensor] = []
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        locals_.append(local)
        if counted_here(g) and not skip(p):
            total += local.detach().to(torch.float64).pow(2).sum().cpu()
    device = locals_[0].device if locals_ else torch.device("cpu")
    total = total.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    norm = math.sqrt(float(total))
    coefficient = min(1.0, max_norm / (norm + EPS))
    if coefficient < 1.0 and locals_:
        torch._foreach_mul_(locals_, coefficient)
    return norm
