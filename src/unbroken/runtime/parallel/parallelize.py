"""The model as this rank holds it: the seam between building a model and training it.

Owns: `parallelize(model, topology, groups)`, called once by the worker on the model it built, before the
optimizer is made: the trainer, persistence and healing see only what it returns and never assume they
hold the whole model. Does not own: building the model (the user's factory), the intra-group process
group (`groups`, made by the worker from torchrun's environment) or the cross-group collectives
(collectives.py).

Today every replica group is one rank, and the model is returned as it is. Sharding inside a group
(FSDP2 `fully_shard` over the group's ranks, then TP and PP, applied in torchtitan's order: TP, then
FSDP) plugs in here; until it does, a topology with more than one rank per group is refused.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed import ProcessGroup

from unbroken.topology import Topology, TopologyError


def parallelize(model: nn.Module, topology: Topology, groups: ProcessGroup | None = None) -> nn.Module:
    """The module this rank trains. Call once, after the model's construction (seeded: identical on every
    rank) and before building the optimizer over its parameters. `groups` is the replica group's own
    process group (None for one-rank groups). Raises TopologyError for a layout it cannot apply."""
    if topology.group_size == 1:
        return model
    raise TopologyError(f"group_size={topology.group_size}: sharding inside a replica group is not supported "
                        f"yet; use one rank per replica group")
