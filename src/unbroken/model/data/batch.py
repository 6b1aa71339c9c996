"""The microbatch value a trainer computes: inputs, targets, the counts its loss weight and the predictor
read, and optional per-document position ids; a rank's part of one; seeding its randomness.

Owns: `Microbatch`, `part`, `seed_microbatch`. Does not own: which tokens a microbatch holds (source.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def seed_microbatch(seed: int) -> None:
    """Seed the generators a microbatch's randomness (dropout) draws from: the CPU generator and, once
    CUDA is initialized, the current device's. Call before each microbatch's forward.

    The same streams as `torch.manual_seed(seed)` gives that work, at ~2 us instead of ~0.7 ms:
    torch.manual_seed also seeds every CUDA, XPU and MTIA device lazily, and each lazy call records a
    Python stack trace (traceback.format_stack) while its backend is not initialized, three a call on a
    CPU-only build; at two microbatches a step that was ~2.5% of a replica's time (py-spy)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


@dataclass(frozen=True)
class Microbatch:
    x: torch.Tensor  # (B, T) int64 inputs
    y: torch.Tensor  # (B, T) int64 targets, `ignore_index` where padded
    tokens: int  # targets that count (not padding)
    sumsq: int  # sum over sequences of length**2: the attention work, for the predictor
    # (B, T) int64 position of each input inside its document (0 at the window's start and after each
    # document boundary), where the data marks documents; None: 0..T-1. A model reads it where its plan
    # names it among its inputs (model/plan.py).
    positions: torch.Tensor | None = None
    ignore_index: int = -1  # the target of a padded position (config data.ignore_index)


def part(mb: Microbatch, rank: int, parts: int, ignore_index: int = -1) -> Microbatch:
    """Rank `rank`'s share of microbatch `mb` inside a replica group of `parts` ranks: its rows (sequences)
    rank*B/parts .. (rank+1)*B/parts - 1, with their own token count and sum of squared lengths, so that
    its loss weighted by its tokens over the step's sums, over the group's ranks, to the whole
    microbatch's. A pure function of the data API: B must be a multiple of `parts` (api.check_data_object
    checks a user's data before start). `mb` may be any object with the documented fields `x`, `y`, `tokens`
    and `sumsq`: `positions` and `ignore_index` are read where it has them, else none and `ignore_index`
    (the run's data.ignore_index)."""
    if parts == 1:
        return mb
    ignore = getattr(mb, "ignore_index", ignore_index)
    n = mb.x.shape[0] // parts
    rows = slice(rank * n, (rank + 1) * n)
    x, y = mb.x[rows], mb.y[rows]
    lengths = (y != ignore).sum(dim=1).tolist()  # targets that count, per sequence
    positions = getattr(mb, "positions", None)
    return Microbatch(x, y, sum(lengths), sum(n * n for n in lengths), None if positions is None else positions[rows],
                      ignore)
