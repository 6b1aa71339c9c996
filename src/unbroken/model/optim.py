"""What every pre-training run's optimizer step has: a learning-rate schedule, parameter groups, clipping.

Owns: the schedule (`lr_factor`, `lr_at`): linear warmup, then cosine, linear, constant or
warmup-stable-decay down to `min_lr_ratio` of the peak, a pure function of the committed step, so a retry,
a heal, a restart from memory or disk and `unbroken resume` all step at the failure-free run's lr;
the default parameter groups (`param_groups`: no weight decay on norms, biases and embeddings, nanoGPT's
and torchtitan's convention, each configurable); and clipping by the global norm of a gradient that this
process holds whole (`clip_whole`, torch's own `clip_grad_norm_`). Does not own: when the optimizer
steps (the trainer), or the norm of a gradient spread over a group's ranks (runtime/parallel/clipping.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from unbroken.config import OptimConfig

NO_DECAY = "_unbroken_no_decay"  # set on a parameter that `param_groups` keeps out of weight decay


def lr_factor(step: int, o: OptimConfig, steps: int) -> float:
    """The lr of committed step `step` (0-based) as a fraction of `optim.lr`, for a run of `steps` steps.

    warmup: (step + 1) / warmup_steps for the first warmup_steps steps (the first step is not at 0).
    Then, over the remaining steps up to `steps`, progress p from 0 to 1:
      constant  1
      linear    1 - (1 - min) * p
      cosine    min + (1 - min) * (1 + cos(pi * p)) / 2
      wsd       1 until the last `decay_steps` steps, then linear down to min over them
    where min = `min_lr_ratio`. Pure: the same float for the same arguments on every process."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    lo = o.min_lr_ratio
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        decay = min(o.decay_steps, steps - o.warmup_steps)
        start = steps - decay
        if step < start or decay <= 0:
            return 1.0
        return 1.0 - (1.0 - lo) * (step - start + 1) / decay
    span = max(1, steps - o.warmup_steps - 1)
    p = min(1.0, (step - o.warmup_steps) / span)
    if o.schedule == "linear":
        return 1.0 - (1.0 - lo) * p
    return lo + (1.0 - lo) * (1.0 + math.cos(math.pi * p)) / 2.0


def lr_at(step: int, o: OptimConfig, steps: int) -> float:
    """The learning rate of committed step `step` under the configured schedule."""
    return o.lr * lr_factor(step, o, steps)


def mark_no_decay(model: nn.Module, o: OptimConfig) -> None:
    """Mark the parameters that `param_groups` keeps out of weight decay: those of fewer than 2 dimensions
    (norms' scales, biases) unless `decay_norms_and_biases`, and embedding tables (an `nn.Embedding`'s
    weight, and the names the model's `no_weight_decay()` gives, a head tied to one) unless
    `decay_embeddings`. Call once, after the model is parallelized
    (the marks go on the parameters it holds then)."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.ndim < 2 and not o.decay_norms_and_biases:
                setattr(p, NO_DECAY, True)
        if isinstance(module, nn.Embedding) and not o.decay_embeddings:
            setattr(module.weight, NO_DECAY, True)
    # A model may name its embeddings (timm's convention): a weight tied to one on another pipeline
    # stage is no nn.Embedding there, and must decay as its twin does.
    named = getattr(model, "no_weight_decay", None)
    if callable(named) and not o.decay_embeddings:
        names = set(named())
        for name, p in model.named_parameters():
            if name in names:
                setattr(p, NO_DECAY, True)


def param_groups(params: Iterable[nn.Parameter], o: OptimConfig) -> list[dict]:
    """The default optimizer's groups, in parameter order within each: decayed, then not decayed (marked
    by `mark_no_decay`). A group left empty is left out."""
    params = list(params)
    decay = [p for p in params if not getattr(p, NO_DECAY, False)]
    keep = [p for p in params if getattr(p, NO_DECAY, False)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def default_optimizer(params: list[nn.Parameter], cfg) -> torch.optim.Optimizer:
    """AdamW over `param_groups` at the peak lr (the trainer sets each step's lr from the schedule)."""
    o = cfg.optim
    return torch.optim.AdamW(param_groups(params, o), lr=o.lr, betas=(o.beta1, o.beta2),
                             weight_decay=o.weight_decay)


def clip_whole(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of parameters this process holds whole (a one-rank group, a stand-in) to a
    global 2-norm of `max_norm` (torch's `clip_grad_norm_`, foreach); returns the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True))
