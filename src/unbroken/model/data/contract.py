"""The data contract a user's `data(cfg)` object signs (README, "Your own model and data"), checked in the
launching process before any worker starts, so that a broken object or a layout its microbatches cannot
serve ends `unbroken.train` with one ConfigError line instead of every worker's traceback.

Owns: `check_data_object`. Does not own: token files (check.py) or the built-in source (source.py).
"""
from __future__ import annotations

from collections.abc import Callable

from unbroken.config import ConfigError

FIELDS = ("x", "y", "tokens", "sumsq")


def check_data_object(cfg, data: Callable, builtin_model: bool = False) -> None:
    """Build `data(cfg)` once and read its microbatch (0, 0): it must have `microbatch` and `step_tokens`,
    the four fields, `x` and `y` tensors of the same rows (their first dimension: the model's forward(x, y)
    reads them as it likes), rows a multiple of the group's FSDP2 shards (each shard takes an equal share of
    every microbatch's rows); where the built-in model trains (`builtin_model`), x (rows, tokens) of token
    ids within model.block_size. Raises ConfigError (one line naming what to change). Call once, before
    launching."""
    import torch

    obj = data(cfg)
    missing = [m for m in ("microbatch", "step_tokens") if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"data: the object data(cfg) returned has no {' or '.join(missing)} method "
                          f"(the contract: microbatch(step, i) and step_tokens(step, M))")
    mb = obj.microbatch(0, 0)
    absent = [f for f in FIELDS if not hasattr(mb, f)]
    if absent:
        raise ConfigError(f"data: microbatch(0, 0) has no field {', '.join(absent)} (the contract: x, y, tokens, "
                          f"sumsq)")
    x, y = mb.x, mb.y
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 1 and y.dim() >= 1
            and x.shape[0] == y.shape[0]):
        raise ConfigError(f"data: microbatch(0, 0)'s x and y must be tensors of the same rows (their first "
                          f"dimension); got {_describe(x)} and {_describe(y)}")
    rows = x.shape[0]
    shards = cfg.topology().dp_shard
    if rows % shards:
        raise ConfigError(f"data: microbatch(0, 0) has {rows} rows, which parallel.group_size="
                          f"{cfg.parallel.group_size}'s {shards} FSDP2 shards do not divide (each takes an equal "
                          f"share of every microbatch's rows): give each microbatch a multiple of {shards} rows")
    if builtin_model and (x.dim() != 2 or x.is_floating_point() or x.shape[1] > cfg.model.block_size):
        raise ConfigError(f"data: microbatch(0, 0)'s x is {_describe(x)}; the built-in model (model.arch="
                          f"{cfg.model.arch}) takes (rows, tokens) token ids, at most model.block_size="
                          f"{cfg.model.block_size} tokens a row")


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if hasattr(t, "shape") else type(t).__name__
