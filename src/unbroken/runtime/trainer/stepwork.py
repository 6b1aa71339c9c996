"""The data of one training step while it runs: passed to every stage of the step, never kept on the trainer;
and what the trainer trains, as the worker built it (`Parts`).

Owns: `StepWork`, what a step holds from its first microbatch until its commit (and, pipelined, until its
decision is read): the step's local gradient sum, the timings of the microbatches it computed, its token
count, its reduction's result and the copies it reduces, the decision it read; `GradientSink`, where the
gradient hooks put what they receive (pointed at the step computing); `OwnShard`, a plain rank's holding
with a stand-in's interface. Does not own: what happens to them (step.py executes the policy's actions on
a step; speculation.py keeps a step that stepped ahead of its decision).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from unbroken.runtime.trainer.membership import Decision
from unbroken.runtime.parallel.accumulator import Accumulator
from unbroken.runtime.parallel.pipeline import Stages
from unbroken.runtime.parallel.standin import StandIn


@dataclass(frozen=True)
class Parts:
    """What this rank trains, built by the worker: the model as this rank holds it (parallelize), the
    data source (microbatch(step, i), step_tokens(step, M)) and the optimizer over the model's parameters."""
    model: nn.Module
    data: object
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None = None  # the replica group's own ranks (parallelize.intra_group)
    stages: Stages | None = None  # this rank's pipeline stage, when the group's ranks are stages (pipeline.py)
    standin: StandIn | None = None  # a shrunk group's rank holding several shard indices (standin.py)
    inputs: tuple[str, ...] = ()  # microbatch fields the model's forward takes as keywords (its plan's)
    applied: dict = field(default_factory=dict)  # what parallelize applied (parallelize.describe), for the log


def model_inputs(mb, names: tuple[str, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of a forward over microbatch (or share) `mb`: each field of `names` that `mb`
    holds (not None), on `device`. A share's fields are its rows (data.part cuts them with x and y)."""
    return {n: getattr(mb, n).to(device) for n in names if getattr(mb, n, None) is not None}


@dataclass
class StepWork:
    """One step's working data. The accumulator is kept for a retry (the step goes on from it); two
    alternate between steps, since step s+1 computes while s, pipelined, awaits its decision."""
    step: int
    acc: Accumulator
    tokens: int  # tokens in the whole step (every microbatch): the loss weights' denominator
    started: float  # time.time() at the step's start
    # mb -> (tokens, sumsq, this rank's own device s)
    timings: dict[int, tuple] = field(default_factory=dict)
    waited: float = 0.0  # s spent waiting on peers' decisions or epochs (after any step ahead)
    stepped: float = 0.0  # time.time() after its optimizer step
    decision: Decision | None = None  # the last decision read of this step
    next_plan: Future = field(default_factory=Future)  # the next step's plan: its commit carries it
    members: tuple[int, ...] = ()  # the step's own members as its state machine last said
    reduced: list[torch.Tensor] | None = None  # its last all-reduce's results, one per shard index held
    lr: float | None = None  # the lr its optimizer step took (model/optim.py: a function of the step)
    grad_norm: float | None = None  # its reduced gradient's global norm before clipping (None: no clipping)
    # shard index -> the all-reduce's copy of the accumulator, kept from step to step (the trainer's one
    # pool, given to each step): a failure leaves the accumulator itself intact. Cleared when a
    # reduction is abandoned, since the abandoned collective may still write into them.
    copies: dict[int, torch.Tensor] = field(default_factory=dict)
    # its reduction overlapped with its last backward (reduction.py): (epoch, members) once marked, then
    # the reduction issued from the backward (reduction.InFlight) once armed; None: not overlapped
    overlap: object | None = None

    def held(self) -> tuple[int, ...]:
        """The microbatches this member computed in the step (the policy's `held`), in order."""
        return tuple(sorted(self.timings))

    def timings_of(self, held: tuple[int, ...]) -> list[tuple]:
        return [self.timings[i] for i in held]


class GradientSink:
    """Where the gradient hooks (a pipeline stage's, FSDP2's reduce-scatter output under --exact, a
    stand-in's) put each gradient: the accumulator of the step computing now. Point it at a step's
    accumulator (`point_at`) before that step's first backward; the hooks are set once, at build."""

    def __init__(self, acc):
        self.acc = acc

    def point_at(self, acc) -> None:
        self.acc = acc

    def add_shard(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.acc.add_shard(param, grad)


class OwnShard:
    """A plain rank's holding, with the interface of a stand-in (parallel/standin.StandIn) that the step
    uses: the one shard index it holds is its own, and every parameter it has is that index's."""

    def __init__(self, params: list[torch.Tensor], rank: int):
        self.held, self._params = (rank,), params
        self.seed: int | None = None  # a stand-in reseeds its merged stages from it; a plain rank need not

    def parameters(self, shard: int) -> list[torch.Tensor]:
        return self._params
