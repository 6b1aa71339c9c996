"""A rank's compute backend, chosen once for the layout it runs (`backend_for`), so the step asks it and never
the mode: `Replica` (a one-rank replica, or an FSDP2 or TP group's rank: each microbatch's forward and
backward in turn), `StandInRank` (a shrunk group's rank holding several shard indices: each of their rows
in turn) and `PipelineStage` (a pipeline stage, TP, FSDP2 or a stand-in's merged stages inside: the
microbatches fed through the stage's schedule as one). A layer moving between stages is a change to
`PipelineStage` and the pipeline it drives.

Owns: the accumulator a step computes into (its dtype and whether hooks fill it), the gradient hooks that
fill it, the order of a step's forwards and backwards, each microbatch's seeding (a pure function of (seed,
step, i), never of the rank), its loss weight, the compute fault points, and the device time each microbatch
took (handed to `record`). Does not own: the accumulator's arithmetic (accumulator.py), the reduction
(reduction.py), silent-corruption duties (integrity.py), the step's protocol (step.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.model.data import mix, part, seed_microbatch
from unbroken.policy import recovery as rec
from unbroken.policy.workload import loss_weight
from unbroken.runtime.parallel.accumulator import Accumulator
from unbroken.runtime.parallel.parallelize import reduced_shards
from unbroken.runtime.trainer.stepwork import GradientSink, StepWork, model_inputs


@dataclass(frozen=True)
class Computing:
    """What a backend's compute reads of its trainer, fixed for the trainer's life (`Backend.attach`)."""
    cfg: Any  # the run's Config
    role: Any  # role.RankRole: its shares, whether it counts the loss, FSDP2 or not
    model: Any
    data: Any  # microbatch(step, i), step_tokens(step, M)
    device: Any
    inputs: tuple[str, ...]  # the plan's extra forward inputs
    clock: Any  # devicetime.DeviceClock
    hb: Any  # heartbeat.Heartbeat
    faults: Any  # faults.Injector
    holding: Any  # OwnShard or StandIn: seeded per microbatch (a stand-in's merged stages re-seed)
    reducer: Any  # reduction.Reducer: each microbatch's backward
    integrity: Any  # integrity.Integrity
    ahead: Callable[[], None]  # the trainer's look at a newly admitted joiner, between microbatches
    record: Callable[..., None]  # record(work, step, i, microbatch, device_s, wall_s)

    def share(self, whole, share: int):
        """Rows `share` of microbatch `whole` (data.part), padding as the run's data.ignore_index."""
        return part(whole, share, self.role.shares, self.cfg.data.ignore_index)

    def seed(self, step: int, i: int) -> None:
        """Seed microbatch i's randomness (dropout): per microbatch, never per rank; and per stage, as a
        pipeline seeds it (a stand-in's merged stages)."""
        seed_microbatch(seed := mix(self.cfg.run.seed, step, i))
        self.holding.seed = seed


class Backend(ABC):
    """The part of a step its layout decides. Build once per trainer (`backend_for`); `accumulator` for each
    buffer a step computes into (one, or two with commit pipelining), `hook` once with the sink that points
    gradients at the step computing, `attach` once before the first step, then `compute` for every Compute
    action."""

    def __init__(self, model: torch.nn.Module, params: list, role, exact: bool, stages=None, standin=None):
        self.model, self.params, self.role, self.stages, self.standin = model, params, role, stages, standin
        self.dtype = torch.float64 if exact else torch.float32  # the accumulator's: float64 under --exact
        self.exact = exact

    def accumulator(self) -> Accumulator:
        """A fresh accumulator over this rank's parameters. A group's ranks under --exact take the float64
        reduce-scatter output itself (FSDP2 would round it to float32 in .grad): summed over a step's
        batches, rounded once, as one-rank groups do; such an accumulator is `hooked`."""
        return Accumulator(self.params, self.dtype, self.role.fsdp and self.exact)

    def hook(self, sink: GradientSink) -> None:
        """Point the gradient hooks at `sink` (once): FSDP2's reduce-scattered shards under --exact."""
        if self.role.fsdp and self.exact:
            reduced_shards(self.model, sink.add_shard)

    def attach(self, c: Computing) -> None:
        self.c = c

    @abstractmethod
    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        """Forward and backward `microbatches` of `step` into `work.acc`; the Computed event. Call for every
        Compute action, after `attach`, with the sink pointed at `work.acc`."""


class Replica(Backend):
    """Each microbatch's forward and backward in turn, each share of it this rank computes (one; a
    stand-in's several). FSDP2 ranks reduce-scatter once, at the last microbatch (FSDP2 accumulates the
    unsharded gradients of the others, in float64 under --exact)."""

    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        c, role = self.c, self.role
        c.integrity.start(step, work, lambda: work.acc.attach())  # what we recompute for others, first
        for n, i in enumerate(microbatches):
            last = n == len(microbatches) - 1
            if role.fsdp:
                self.model.set_requires_gradient_sync(last)
            c.hb.at(step, "compute", i)
            c.ahead()  # an admission mid-compute: the joiner's groups form from the next microbatch on
            whole = c.data.microbatch(step, i)
            span = c.clock.start()  # device time (devicetime.py): what the detector reads
            for share in role.computes:
                mb = c.share(whole, share)  # this share's sequences
                c.seed(step, i)
                loss = c.model(mb.x.to(c.device), mb.y.to(c.device),
                               **model_inputs(mb, c.inputs, c.device)) * loss_weight(mb.tokens, work.tokens)
                c.integrity.before(step, i, n == 0)  # a flip fault's, a recomputed microbatch's digest
                c.reducer.backward(work, loss, loss if role.counts_loss else loss.new_zeros(()), share,
                                   last=last)  # the record sums shares
                c.integrity.after(step, i)
            if len(role.computes) > 1:
                mb = c.share(whole, 0)  # a stand-in reports rank 0's rows, as its group did
            c.faults.stretch(step, span, mb.tokens, mb.sumsq)
            seconds, wall = span.stop()
            c.record(work, step, i, mb, seconds, wall)
            if n == 0:
                c.faults.at(step, "compute")  # a kill here loses finished and unfinished work alike
        c.integrity.finish(step)  # recomputed ones compared before any is reduced (outvoted: we leave)
        return rec.Computed(microbatches)


class StandInRank(Replica):
    """A shrunk group's rank holding several shard indices (standin.py): its accumulator holds each shard
    index's part, and its per-parameter hooks cut each gradient into them."""

    def accumulator(self) -> Accumulator:
        return self.standin.accumulator(self.dtype, self.params)

    def hook(self, sink: GradientSink) -> None:
        self.standin.attach(self.params, sink.add_shard)


class PipelineStage(Backend):
    """The microbatches fed through this rank's pipeline stage as one schedule (every rank of the group
    runs the same ones, a retry's redone ones too); each microbatch's gradients reach the accumulator one
    by one (pipeline.py: the stage hands them over itself, so the accumulator is hooked). A schedule
    interleaves its microbatches, so one's own device time is not separable: the call's is shared out by
    tokens, the predictor's main feature."""

    def accumulator(self) -> Accumulator:
        if self.standin is not None:  # a re-formed stage holding every shard (replan_reform.py)
            return self.standin.accumulator(self.dtype, self.params)
        return Accumulator(self.params, self.dtype, True)

    def hook(self, sink: GradientSink) -> None:
        self.stages.sink = sink.add_shard
        if self.role.fsdp:  # FSDP2 inside the stages: a batch's reduce-scattered shards (pipeline.Stages)
            reduced_shards(self.model, self.stages.took_shard)

    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        c, role = self.c, self.role
        # (microbatch, share) in schedule order: this rank's FSDP shard's rows of each (whole without FSDP2),
        # or each shard's rows in turn on a re-formed stage holding every shard (replan_reform.py)
        items = [(i, share) for i in microbatches for share in role.computes]
        wholes = {i: c.data.microbatch(step, i) for i in microbatches}
        mbs = [c.share(wholes[i], share) for i, share in items]

        def before(k: int) -> None:  # this stage's forward of item k
            c.hb.at(step, "compute", items[k][0])
            c.seed(step, items[k][0])

        def after(k: int) -> None:
            if k == 0:
                c.faults.at(step, "compute")  # a kill here leaves the pipeline in flight

        span = c.clock.start()
        weights = [loss_weight(mb.tokens, work.tokens) for mb in mbs]
        for k, loss in enumerate(self.stages.run(mbs, weights, before, after)):  # the last stage's, in order
            work.acc.add(loss if role.counts_loss else loss.new_zeros(()), items[k][1])
        c.faults.stretch(step, span, sum(mb.tokens for mb in mbs), sum(mb.sumsq for mb in mbs))
        own, wall = span.stop()
        # This stage's own time, its schedule's share of each microbatch by tokens (a stand-in for several
        # shards reports its first share's rows, as `Replica` does); the group's is its slowest stage's
        # (slowness.group_timings): a stage waiting on a slow peer's send spends no device time.
        tokens = sum(mb.tokens for mb in mbs)
        for i in microbatches:
            share = sum(mb.tokens for (j, _), mb in zip(items, mbs) if j == i) / tokens
            c.record(work, step, i, c.share(wholes[i], role.computes[0]), own * share, wall * share)
        return rec.Computed(microbatches)


def backend_for(model: torch.nn.Module, params: list, role, exact: bool, stages=None, standin=None) -> Backend:
    """The backend of the layout this rank runs: a pipeline stage where it has `stages`, else a stand-in
    where it holds several shard indices (`standin`), else a replica (one rank, or an FSDP2 or TP rank of
    its group). Call once per trainer, before its accumulators."""
    if stages is not None:
        return PipelineStage(model, params, role, exact, stages, standin)
    if standin is not None:
        return StandInRank(model, params, role, exact, stages, standin)
    return Replica(model, params, role, exact)
