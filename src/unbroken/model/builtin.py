"""The built-in models by name, and the check of a model's plan before any worker starts.

Owns: `built_in` (the model that model.arch names) and `check` (a plan against the requested degrees, on
the model built on the meta device, and whether its groups can re-form onto fewer ranks). Does not own: the models (gpt.py, llama.py) or plans (plan.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from unbroken.model.gpt import GPT
from unbroken.model.llama import Llama
from unbroken.model.plan import ParallelPlan, plan_of, problems, reform_problem


def built_in(cfg, ignore_index: int = -1) -> nn.Module:
    """The built-in model that `cfg.arch` names (a ModelConfig): "gpt" or "llama", its loss ignoring
    targets of `ignore_index` (config data.ignore_index). Call after seeding."""
    return Llama(cfg, ignore_index) if cfg.arch == "llama" else GPT(cfg, ignore_index)


def check(cfg, model: Callable | None = None, plan: ParallelPlan | None = None) -> str | None:
    """Raise ConfigError (one line) where the plan cannot do what `cfg`'s parallel.tp and parallel.pp ask:
    `plan` (else the model's own) on the model `model(cfg)` builds (else the built-in one), built on the
    meta device (no memory, no initialisation). Returns why its groups cannot re-form onto fewer ranks
    under parallel.on_rank_loss=replan (plan.reform_problem), None where they can or the run drops
    them. Call before any worker starts; a factory that cannot build on the meta device is left to the
    workers, which check again (runtime/parallel/parallelize.py), and counts as able to re-form."""
    from unbroken.config import ConfigError

    try:
        with torch.device("meta"):
            whole = model(cfg) if model is not None else built_in(cfg.model)
    except Exception:  # noqa: BLE001 - a user's factory that needs real tensors: the workers check
        return None
    plan = plan or plan_of(whole)
    wrong = problems(whole, plan, cfg.parallel.tp, cfg.parallel.pp)
    if wrong:
        raise ConfigError(wrong[0])
    return reform_problem(whole, plan, cfg.parallel.tp) if cfg.parallel.on_rank_loss == "replan" else None
