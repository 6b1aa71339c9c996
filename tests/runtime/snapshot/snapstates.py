"""The snapshot tests' states: a deterministic one per step, and bit-exact equality of two.

A module of its own, not conftest.py: the tests import these by name, and a bare `conftest` is whichever
conftest pytest imported last (tests/sim has one too: a run given files of both folders failed to
import `same`)."""

from __future__ import annotations

import torch


def state(step: int, n: int = 50_000) -> dict[str, torch.Tensor]:
    """A deterministic mixed-dtype state for `step`, with an odd-sized tensor to test alignment."""
    g = torch.Generator().manual_seed(1234 + step)
    return {
        "w": torch.randn(n, generator=g),
        "flag": torch.randint(0, 2, (7,), generator=g, dtype=torch.uint8),
        "m": torch.randn(n // 3, 3, generator=g).to(torch.bfloat16),
        "pos": torch.tensor([step, 10 * step], dtype=torch.int64),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two states."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        if a[k].dim() else torch.equal(a[k], b[k]) for k in a)
