"""How a rank computes a step's microbatches into its accumulator, chosen once for the layout it runs, so
the step asks it and never the mode: `Microbatches` (a one-rank replica, an FSDP2 or TP group's rank, a
stand-in holding several shard indices: each microbatch's forward and backward in turn) and `Schedule` (a
pipeline stage, TP inside or not: the microbatches fed through the stage's schedule as one).

Owns: the order of a step's forwards and backwards, each microbatch's seeding (a pure function of (seed,
step, i), never of the rank), its loss weight, the compute fault points, and the device time each
microbatch took (handed to `record`). Does not own: the accumulator and its hooks (accumulator.py,
step.py), the reduction (reduction.py), silent-corruption duties (integrity.py), the step's protocol.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.model.data import mix, part, seed_microbatch
from unbroken.policy import recovery as rec
from unbroken.policy.workload import loss_weight
from unbroken.runtime.trainer.stepwork import StepWork, model_inputs


@dataclass(frozen=True)
class Computing:
    """What computing reads of its trainer, fixed for the trainer's life."""
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
    stages: Any  # pipeline.Stages, or None
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


class Microbatches:
    """Each microbatch's forward and backward in turn, each share of it this rank computes (one; a
    stand-in's several). FSDP2 ranks reduce-scatter once, at the last microbatch (FSDP2 accumulates the
    unsharded gradients of the others, in float64 under --exact)."""

    def __init__(self, c: Computing):
        self.c = c
        self.sync = c.model.set_requires_gradient_sync if c.role.fsdp else None

    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        c, role = self.c, self.c.role
        c.integrity.start(step, work, lambda: work.acc.attach())  # what we recompute for others, first
        for n, i in enumerate(microbatches):
            last = n == len(microbatches) - 1
            if self.sync is not None:
                self.sync(last)
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


class Schedule:
    """The microbatches fed through this rank's pipeline stage as one schedule (every rank of the group
    runs the same ones, a retry's redone ones too); each microbatch's gradients reach the accumulator one
    by one (pipeline.py). A schedule interleaves its microbatches, so one's own device time is not
    separable: the call's is shared out by tokens, the predictor's main feature."""

    def __init__(self, c: Computing):
        self.c = c

    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        c, role = self.c, self.c.role
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
        for k, loss in enumerate(c.stages.run(mbs, weights, before, after)):  # the last stage's, in order
            work.acc.add(loss if role.counts_loss else loss.new_zeros(()), items[k][1])
        c.faults.stretch(step, span, sum(mb.tokens for mb in mbs), sum(mb.sumsq for mb in mbs))
        own, wall = span.stop()
        # This stage's own time, its schedule's share of each microbatch by tokens (a stand-in for several
        # shards reports its first share's rows, as `Microbatches` does); the group's is its slowest
        # stage's (slowness.group_timings): a stage waiting on a slow peer's send spends no device time.
        tokens = sum(mb.tokens for mb in mbs)
        for i in microbatches:
            share = sum(mb.tokens for (j, _), mb in zip(items, mbs) if j == i) / tokens
            c.record(work, step, i, c.share(wholes[i], role.computes[0]), own * share, wall * share)
        return rec.Computed(microbatches)


def computing_for(c: Computing) -> Microbatches | Schedule:
    """The way this rank computes, by its layout: a pipeline stage's schedule, else microbatch by
    microbatch. Call once per trainer."""
    return Schedule(c) if c.stages is not None else Microbatches(c)
