"""The committed gradient on its way into the optimizer: into `.grad`, clipped, at the step's lr.

Owns: loading a step's reduced gradient, clipping it by its global norm (optim.max_grad_norm: torch's own
clip_grad_norm_ where this process holds the whole model, a group-wide norm where its ranks hold parts of
it: runtime/parallel/clipping.py), and setting every parameter group's lr for the committed step (a user's
`lr_schedule`, or the [optim] schedule as a factor on each group's own lr: model/optim.py). The lr is a
pure function of the step, so a retry, a heal, a restart or a resume steps at the failure-free lr. Does
not own: when the optimizer steps (step.py) or the parameter groups (the optimizer factory).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from unbroken.config import Config
from unbroken.model.optim import clip_whole, lr_factor
from unbroken.runtime.parallel.clipping import clip_group
from unbroken.runtime.trainer.stepwork import Parts, StepWork


class Optimizing:
    """Build once per trainer, after its optimizer; call `prepare` once per committed step, on every rank
    of a group at once (clipping is a collective there), right before the optimizer steps."""

    def __init__(self, cfg: Config, parts: Parts, params: list[torch.Tensor],
                 lr_schedule: Callable[[int], float] | None = None):
        self.cfg, self.params, self.group, self.stages = cfg, params, parts.group, parts.stages
        self.optimizer, self.lr_schedule = parts.optimizer, lr_schedule
        for group in self.optimizer.param_groups:  # the lr the configured schedule scales, per group
            group.setdefault("initial_lr", group["lr"])

    def prepare(self, work: StepWork) -> float:
        """`work`'s reduced gradient into `.grad`, clipped, and the step's lr set; returns the step's loss
        (a group's rank: its share). Sets `work.grad_norm` (None without clipping) and `work.lr`."""
        loss = work.acc.load_reduced(work.reduced)
        work.grad_norm = self.clip() if self.cfg.optim.max_grad_norm > 0 else None
        work.lr = self.set_lr(work.step)
        return loss

    def clip(self) -> float:
        """Clip to optim.max_grad_norm; the global norm before clipping, the same on every rank."""
        max_norm = self.cfg.optim.max_grad_norm
        if self.group is None:  # the whole model here: a one-rank group, or a stand-in for a whole group
            return clip_whole(self.params, max_norm)
        first = self.stages is None or self.stages.index == 0  # a tied weight counts on the first stage
        return clip_group(self.params, max_norm, self.group,
                          skip=lambda p: not first and self.stages.holds_tied(p))

    def set_lr(self, step: int) -> float:
        """Every parameter group's lr for committed step `step`; group 0's."""
        if self.lr_schedule is not None:
            lr = float(self.lr_schedule(step))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        else:
            factor = lr_factor(step, self.cfg.optim, self.cfg.run.steps)
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]
