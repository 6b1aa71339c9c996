"""The oracles' own optimizer, written outside unbroken: AdamW with the parameter groups every pre-training
run uses (no weight decay on norms, biases and embeddings), built from the model's modules here, not by
unbroken's code, so a wrong grouping in the product shows up as a digest mismatch."""
from __future__ import annotations

import torch
import torch.nn as nn


def adamw(model: nn.Module, params: list[nn.Parameter], o) -> torch.optim.AdamW:
    """AdamW over `params` (in their order) with `o`'s hyper-parameters: 2-D or larger tensors decayed,
    except embedding tables; 1-D ones (norm scales, biases) not."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in params if p.ndim >= 2 and id(p) not in embeddings]
    keep = [p for p in params if p.ndim < 2 or id(p) in embeddings]
    groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay}, {"params": keep, "weight_decay": 0.0})
              if g["params"]]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
