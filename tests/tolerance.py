"""How far float32 arithmetic in another order may move a run's per-step loss: the bound that tests comparing
a reordered run (a TP group re-formed at another degree, FSDP x TP, PP x TP) with the plain loop hold it to.

Two float32 evaluations of the same step that differ only in the order of their sums (TP splits a matmul's
inner sum in halves and adds the halves; a re-form at TP 1 sums it whole) differ by their rounding errors.
For an inner product of length K, each order's error is at most lambda * sqrt(K) * u * sum_i |a_i b_i| with
probability at least 1 - 2 exp(-lambda^2 / 2) (Higham and Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 2019; u = 2^-24, float32's unit roundoff). lambda = 6 leaves a
probability below 3e-8 per element.

The bound is derived by running the plain loop (the oracle, no unbroken code) with every matmul's output
moved by exactly that amount, with a random sign per element (`perturb_linears`), and every parameter's
gradient likewise by the same rule over the gradient's own reduction over tokens: a run whose every sum
carries a worst-case-probable rounding error, on every step and in every layer, which is more than any
reordering changes (a TP re-form reorders the row-parallel sums only). AdamW's amplification of small
gradient differences (near-zero gradients, divided by their own root mean square) is inside that run, over
the steps the test runs. The bound at step s is the largest relative loss difference between the plain
loop and `SEEDS` such runs, up to step s (a difference, once made, may shrink later by chance, not by
right), times 2: the reordered run and the plain loop each carry their own rounding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

U = 2.0 ** -24  # float32's unit roundoff
LAMBDA = 6.0  # Higham-Mary's lambda: a bound exceeded with probability < 3e-8 per element
SEEDS = (1, 2)


def perturbation(abs_product: torch.Tensor, inner: int, generator: torch.Generator) -> torch.Tensor:
    """The rounding error a sum of `inner` terms may carry, elementwise, with a random sign:
    lambda * sqrt(inner) * u * sum |a_i b_i| (`abs_product`, same shape as the result)."""
    sign = torch.randint(0, 2, abs_product.shape, generator=generator).to(abs_product.dtype) * 2 - 1
    return LAMBDA * math.sqrt(inner) * U * abs_product * sign


@contextmanager
def perturb_linears(model: torch.nn.Module, seed: int) -> Iterator[None]:
    """While inside, every nn.Linear's output (..., out) moves by its probable rounding error (inner sum
    length: in_features) and every parameter's gradient by the error of its reduction over the batch's
    tokens (inner sum length: tokens in the microbatch, read from the first Linear's input)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [1]

    def forward(module: torch.nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        tokens[0] = max(1, x.numel() // x.shape[-1])
        with torch.no_grad():
            bound = x.abs() @ module.weight.abs().t()
        return out + perturbation(bound, module.in_features, gen)

    def grad(g: torch.Tensor) -> torch.Tensor:
        return g + perturbation(g.abs(), tokens[0], gen)

    handles = [m.register_forward_hook(forward) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    handles += [p.register_hook(grad) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reorder_bound(losses: Callable[[int | None], list[float]]) -> tuple[list[float], list[float]]:
    """The plain loop's per-step losses, and per step the relative loss difference a float32 reordering may
    make by then (module docstring). `losses(seed)` runs the plain loop and returns its per-step losses:
    `None` unperturbed, a seed under `perturb_linears(model, seed)`. Costs len(SEEDS) + 1 plain loops."""
    plain = losses(None)
    worst = [0.0] * len(plain)
    for seed in SEEDS:
        for s, (a, b) in enumerate(zip(losses(seed), plain)):
            worst[s] = max(worst[s], abs(a - b) / abs(b))
    return plain, [2 * max(worst[:s + 1]) for s in range(len(worst))]


def assert_within(recorded: list[float], plain: list[float], bound: list[float], what: str) -> None:
    """Each step's relative loss difference between `recorded` and `plain` is within `bound`; prints both."""
    drift = [abs(a - b) / abs(b) for a, b in zip(recorded, plain)]
    print(f"{what}: largest relative loss drift {max(drift):.2e} (step {drift.index(max(drift))}); "
          f"float32 reordering bound there {bound[drift.index(max(drift))]:.2e}, at most {max(bound):.2e}")
    over = [(s, d, b) for s, (d, b) in enumerate(zip(drift, bound)) if d > b]
    assert not over, f"{what}: (step, drift, bound) over the float32 reordering bound: {over}"
