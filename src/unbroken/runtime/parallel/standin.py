"""A shrunk replica group: one rank that holds every shard index of its group's plan (the whole model of
a pipeline group whose other stage was lost), so that it keeps reducing, digesting and healing per shard
index exactly as the full group did.

Owns: which of the whole model's parameters make up each shard index (`StandIn.shards`: pipeline stage
j's parameters, as `pipeline.split` leaves them on rank j); the accumulator that files each microbatch's
gradient under every shard index holding the parameter (`ShardedAccumulator`); the forward hook that
re-seeds a microbatch's dropout at each stage boundary, as a pipeline's stages each seed it. Does not own:
deciding to shrink (policy/scheduling.py, asked by the coordinator: replanning.py), the step (trainer.py),
or the transfer (persist/healing.py, called once per shard index).

Why one rank can stand in bitwise for a pipeline (`--exact`): a microbatch's gradient of each parameter is
the same float32 tensor whether its stage's layers run alone or inside the whole model (same kernels,
same inputs); the tied embedding/head weight's per-microbatch gradient is the sum of its two float32
parts either way (autograd sums them here, one all-reduce over the stages there: two addends, the same
bits in either order); and every shard index still sums the same per-microbatch gradients in float64,
in microbatch order, before the cross-group all-reduce of that shard index.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from unbroken.model.data import seed_microbatch
from unbroken.runtime.gradients import Accumulator
from unbroken.runtime.parallel.pipeline import stage_names


class ShardedAccumulator:
    """One `Accumulator` per shard index over that shard's parameters (a tied weight in each shard that
    holds it), with the interface the trainer uses. Gradients arrive through `add_shard` (the hooks of
    `StandIn.attach`), one microbatch at a time; the weighted loss goes to the last shard index, as the
    last pipeline stage counts it."""

    def __init__(self, shards: list[list[nn.Parameter]], dtype: torch.dtype, params: list[nn.Parameter]):
        self.parts = [Accumulator(ps, dtype, hooked=True) for ps in shards]
        self.params = params  # the whole model's, tied once
        self._holders = {id(p): [a for a in self.parts if id(p) in a._slot] for p in params}

    @property
    def buffer(self) -> torch.Tensor:  # step.py reads its dtype and size
        return self.parts[-1].buffer

    def zero(self) -> None:
        for a in self.parts:
            a.zero()

    def add(self, weighted_loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        for a in self.parts[:-1]:
            a.add(weighted_loss.new_zeros(()))
        self.parts[-1].add(weighted_loss)

    def add_shard(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        for a in self._holders[id(param)]:
            a.add_shard(param, grad)

    def load_grads(self, reduced: list[torch.Tensor]) -> float:
        """Each shard index's reduced buffer into `.grad` (a tied weight gets the same sum from each
        shard that holds it); returns the step's loss (the last shard's slot: the others hold 0)."""
        return sum(a.load_grads(r) for a, r in zip(self.parts, reduced))


class StandIn:
    """Build once, on the whole model (after its construction, before the optimizer), for a rank that
    holds shard indices 0..stages-1 of a pipeline group of `stages` stages."""

    def __init__(self, model: nn.Module, stages: int):
        self.model, self.stages = model, stages
        named = dict(model.named_parameters(remove_duplicate=False))
        self.names = [stage_names(model, j, stages) for j in range(stages)]
        self.shards: list[list[nn.Parameter]] = [[named[n] for n in names] for names in self.names]
        self.seed: int | None = None  # the microbatch computing now (trainer.compute sets it)
        firsts = {int(ns[0].split(".")[1]) for ns in self.names[1:] if ns and ns[0].startswith("blocks.")}
        for key, block in model.blocks.items():
            if int(key) in firsts:  # the first block of stage j > 0: that stage seeds its own dropout
                block.register_forward_pre_hook(self._reseed)

    def _reseed(self, _module, _args) -> None:
        if self.seed is not None:
            seed_microbatch(self.seed)

    def accumulator(self, dtype: torch.dtype, params: list[nn.Parameter]) -> ShardedAccumulator:
        return ShardedAccumulator(self.shards, dtype, params)

    def attach(self, params: list[nn.Parameter], sink: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Hand each parameter's per-microbatch float32 gradient to `sink(param, grad)` and clear `.grad`
        (so the next microbatch's gradient is its own, not a float32 running sum). Call once."""
        def took(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None
            sink(p, g)

        for p in params:
            p.register_post_accumulate_grad_hook(took)
