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


def memory_problem(cfg, model: Callable | None = None) -> str | None:
    """Why the run's model cannot fit this host's memory (None: it can, or a user's factory cannot build on
    the meta device): every replica group the local launcher starts here holds the model's parameters,
    their gradients and AdamW's two moments in float32 (16 bytes a parameter), and under run.exact a
    float64 accumulator (8 more), spread over its ranks (FSDP2) but whole on the host. Counted on the
    model built on the meta device. Call before any worker starts (api.check_host)."""
    import os

    try:
        with torch.device("meta"):
            whole = model(cfg) if model is not None else built_in(cfg.model)
    except Exception:  # noqa: BLE001 - a user's factory that needs real tensors: the workers find out
        return None
    params = sum(p.numel() for p in whole.parameters())
    need = params * (24 if cfg.run.exact else 16) * cfg.run.replicas
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return None
    m = cfg.model
    what = "the model" if model is not None else \
        f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd}, model.vocab_size={m.vocab_size}"
    return (f"{what}: {params:.3g} parameters need {need / 2**30:.3g} GiB for parameters, gradients and "
            f"optimizer state over run.replicas={cfg.run.replicas}, more than this host's {have / 2**30:.3g} GiB")
