"""A step's cross-replica reduction, as the trainer runs it: on a copy, and for one-rank groups in buckets
overlapped with the backward of the replica's last microbatch.

Owns: `Reducer`, the `Reduce` action (all-reduce a copy of the step's accumulator in the epoch's group,
each shard index it holds; the accumulator stays intact), and the overlap: the post-accumulate-grad
hooks that, during the last microbatch's backward, issue each bucket whose gradients are final
(parallel/buckets.py). Under --exact over whole parameters the same hooks fold each final gradient into
the float64 accumulator and drop it, in every microbatch's backward (any backend). Does not own: the
groups (step.py forms them: `group_of`), what a failed reduction leads to (policy.recovery), or the
step's data (stepwork.py).

When the overlap runs: the group is one rank (plain data parallelism) on a gloo cross group, and the
step's first reduction follows its compute with nothing left to settle first: no previous step awaits
its decision (commit pipelining) and the plan computed under is the agreed one. Then nothing that
would run between the compute and the reduction can change what is reduced or where, and nothing of
the step leaves the process before it would have. Otherwise (a retry's reduction, a step computed
under a proposal not yet agreed, or beside a pipelined previous step) the same buckets go out after
the compute, in the same order: every member issues the same sequence either way. Groups of several
ranks (FSDP2, TP, PP: one all-reduce of each shard index's buffer after the group's reduce-scatter) and
NCCL groups keep one all-reduce of the whole buffer.

Under --exact the float64 buckets are reduce-scattered into a ring of RING slots, each member's chunk
summed and rounded into the float32 gradient, and all-gathered in float32 (parallel/buckets.py): the
scratch is RING slots of (members - 1) / members of a bucket, not the whole float64 buffer (8 bytes a
parameter), at the price of a bucket waiting, inside the backward, for the slot of the one RING before
it: fewer of --exact's buckets overlap the backward than float32's.
"""
from __future__ import annotations

import re

from collections.abc import Callable
from dataclasses import dataclass

import torch

from unbroken.events import EventLog
from unbroken.policy import recovery as rec
from unbroken.runtime.parallel.accumulator import Accumulator
from unbroken.runtime.parallel.buckets import BUCKET_BYTES, BucketedReduce, Layout
from unbroken.runtime.parallel.collectives import CollectiveError, EpochGroup, EpochMoved, ReduceResult
from unbroken.runtime.trainer.stepwork import StepWork

RING = 2  # --exact: float64 bucket slots the reduction works in (a bucket in flight while one is rounded)


def cut_apart_line(me: int, dead: str | None, failure: str) -> str:
    """The one line a group prints as it leaves cut apart from its peers (the coordinator's verdict
    `dead`, policy.membership.cut_apart), naming the peer address its last collective tried (gloo's
    `remote=[ADDR]:PORT` in `failure`); "" for any other verdict."""
    if not dead or "cut apart" not in dead:
        return ""
    tried = re.findall(r"remote=\[([^\]]+)\]:(\d+)", failure)
    where = f"; its last collective tried {tried[-1][0]}:{tried[-1][1]}" if tried else \
        f"; its collectives failed without naming a peer address ({failure[:120]})"
    return f"unbroken: error: group {me} cannot reach its peers and leaves ({dead}){where}"


@dataclass(frozen=True)
class InFlight:
    """A step's reduction issued from its last backward: the group's key and its buckets."""
    key: tuple[int, tuple[int, ...], int]  # (epoch, members, shard)
    reduce: BucketedReduce


@dataclass
class _Armed:
    """The overlap of one step's last backward: its bucketed reduction."""
    step: int
    reduce: BucketedReduce
    fired: bool = False  # the "overlap" fault point passed (at the first bucket issued)


class Reducer:
    """Build once per trainer, after its accumulators and pipeline. `backward` for every microbatch's
    backward, `reduce` for every Reduce action."""

    def __init__(self, role, coord, log: EventLog, faults, heartbeat, pipeline, group_of: Callable,
                 params: list[torch.nn.Parameter], accs: tuple, gloo: bool, bucket_bytes: int = BUCKET_BYTES):
        self.role, self.coord, self.log, self.faults, self.hb = role, coord, log, faults, heartbeat
        self.pipeline, self.group_of = pipeline, group_of
        self.last_failure = ""  # the last cross-group collective's error ("": none)
        plain = all(type(a) is Accumulator and not a.hooked and not a.sharded for a in accs)
        # --exact's buckets travel by gloo's point-to-point sends, which read host memory only: a CUDA
        # rank on a gloo cross group reduces its float64 buffer in one all-reduce instead
        wide = bool(params) and accs[0].buffer.dtype != params[0].dtype
        host = not (wide and accs[0].buffer.device.type != "cpu")
        self.bucketed = role.ranks == 1 and role.indices == 1 and gloo and len(role.holds) == 1 and plain and host
        # --exact over whole parameters: each gradient is folded into the float64 accumulator from its
        # hook and dropped, in every backward, so a model's float32 gradients (4 bytes a parameter)
        # never coexist with it
        self.folds = plain and not accs[0].views
        self.folding: Accumulator | None = None  # the accumulator of the backward running now, if it folds
        self.armed: _Armed | None = None
        self.layout = Layout.of_sizes(accs[0].sizes, accs[0].buffer.element_size(), bucket_bytes) \
            if self.bucketed else None
        if self.bucketed or self.folds:
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(self._hook(i))
            for acc in accs:  # float32 views: each step's first gradient of a parameter is the hook's
                acc.lazy = acc.views

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def final(_: torch.Tensor) -> None:  # parameter i's gradient of this backward is accumulated
            if self.folding is not None:
                self.folding.fold(i)  # before its bucket can be issued
            armed = self.armed
            if armed is None:
                return
            if armed.reduce.ready(i) and not armed.fired:
                armed.fired = True
                # a kill here: buckets in flight, backward still going
                self.faults.at(armed.step, "overlap", issued=len(armed.reduce.issued),
                               buckets=len(self.layout.ranges))
        return final

    def target(self, work: StepWork, state: rec.StepState, queue, settled: bool) -> None:
        """Call once per plan a step computes under, after `rec.start`, before its compute: marks `work`
        to overlap its reduction (the Reduce of `state`'s epoch and members, which follows the compute)
        with its last backward where `settled`: nothing pending and the plan the agreed one."""
        ok = self.bucketed and settled and bool(queue) and isinstance(queue[0], rec.Compute)
        work.overlap = (state.epoch, tuple(state.members)) if ok else None

    def backward(self, work: StepWork, loss: torch.Tensor, counted: torch.Tensor, share: int, last: bool) -> None:
        """`loss.backward()` and fold the microbatch into `work.acc` (`counted`: the loss it adds). The
        last microbatch of a step marked by `target` overlaps its reduction: its loss is added first
        (the same sum in the same order), then its gradients bucket by bucket from the hooks."""
        if not (last and isinstance(work.overlap, tuple)) or self.coord.moved(work.overlap[0]):  # marked: (e, m)
            self._backward(work.acc, loss)
            work.acc.add(counted, share)
            return
        epoch, members = work.overlap
        group = self.group_of(epoch, members, self.role.holds[0])
        if not isinstance(group, EpochGroup):
            self._backward(work.acc, loss)
            work.acc.add(counted, share)
            return
        reduce = self._bucketed(work, group, self.role.holds[0], work.acc.buffer, lambda: self.coord.moved(epoch))
        work.overlap = InFlight((epoch, members, self.role.holds[0]), reduce)
        work.acc.add_loss(counted)
        self.armed = _Armed(work.step, reduce)
        try:
            self._backward(work.acc, loss)
        finally:
            self.armed = None
        work.acc.add(None, share)  # what no hook folded (a parameter without a gradient: nothing)

    def _backward(self, acc: Accumulator, loss: torch.Tensor) -> None:
        """`loss.backward()`, its gradients folded into `acc` from the hooks where the reducer folds."""
        self.folding = acc if self.folds or getattr(acc, "lazy", False) else None  # a stand-in's has none
        try:
            loss.backward()
        finally:
            self.folding = None

    @staticmethod
    def _into(work: StepWork, shard: int, buffer: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The reduction's copy of `buffer` (in `dtype`: the narrowed result under --exact), kept in the
        trainer's pool from step to step."""
        into = work.copies.get(shard)
        if into is None or into.dtype != (dtype or buffer.dtype) or into.numel() != buffer.numel():
            into = work.copies[shard] = torch.empty(buffer.numel(), dtype=dtype or buffer.dtype, device=buffer.device)
        return into

    def _bucketed(self, work: StepWork, group: EpochGroup, shard: int, buffer: torch.Tensor,
                  moved: Callable[[], bool]) -> BucketedReduce:
        """The bucketed reduction of `buffer`. Under --exact (a float64 buffer for float32 parameters) it
        is reduce-scattered through a ring of RING float64 slots and gathered into the float32 gradient
        (BucketedReduce says how); the slots, the result and the float64 loss live in `work.copies`."""
        narrow = work.acc.params[0].dtype
        if buffer.dtype == narrow:
            return BucketedReduce(self.layout, group, buffer, self._into(work, shard, buffer), moved)
        need = BucketedReduce.slot_elements(self.layout, len(group.members))
        ring = [work.copies.get((shard, "ring", k)) for k in range(RING)]
        if any(t is None or t.numel() != need for t in ring):
            ring = [torch.empty(need, dtype=buffer.dtype, device=buffer.device) for _ in range(RING)]
            work.copies.update({(shard, "ring", k): t for k, t in enumerate(ring)})
        loss = work.copies.setdefault((shard, "loss"), torch.empty(1, dtype=buffer.dtype, device=buffer.device))
        return BucketedReduce(self.layout, group, buffer, self._into(work, shard, buffer, narrow), moved, ring, loss)

    def reduce(self, work: StepWork, step: int, epoch: int, members: tuple[int, ...]) -> rec.Event:
        """All-reduce a copy of the accumulator in the group of the step's `members` in `epoch` (a group
        admitted in the epoch joins at the next step); the accumulator stays intact."""
        self.hb.at(step, "allreduce", epoch=epoch)
        overlapped, work.overlap = work.overlap if isinstance(work.overlap, InFlight) else None, None
        if overlapped is not None and overlapped.key != (epoch, members, self.role.holds[0]):
            overlapped.reduce.abandon()  # not the group this reduction runs in: its copy is dropped too
            work.copies.clear()
            overlapped = None
        if self.coord.moved(epoch):  # an epoch that only admits joiners leaves the step in its own
            if overlapped is not None:
                overlapped.reduce.abandon()
                work.copies.clear()
            return rec.EpochChanged(self.coord.chain_after(epoch))
        held = work.held()

        def issued() -> None:  # while the reduction runs (off the path): the done record, the copy of
            self.faults.at(step, "overlap")  # (where no bucket went out during backward)
            self.faults.at(step, "allreduce")  # the state a step ahead would need
            self.coord.stage(step, epoch, held, work.timings_of(held), self.role.timed)
            self.pipeline.save_early()

        results = []
        for shard, buffer in zip(self.role.holds, work.acc.buffers):  # a stand-in: each index it holds
            key = (epoch, members, shard)
            group = self.group_of(*key)
            tag = self.role.shard_tag(shard)
            moved = lambda: self.coord.moved(epoch)  # noqa: E731
            on_issued = issued if not results else None
            extra = {}
            try:
                if self.bucketed and isinstance(group, EpochGroup):
                    bucketed = overlapped.reduce if overlapped else self._bucketed(work, group, shard, buffer, moved)
                    result = bucketed.finish(on_issued)
                    extra = dict(buckets=len(self.layout.ranges), overlapped=bucketed.early)
                    if bucketed.loss is not None:  # --exact: the float32 gradient, then the float64 loss
                        results.append(result.tensor)
                        result = ReduceResult(bucketed.loss, result.seconds)
                else:
                    result = group.allreduce(buffer, moved, on_issued=on_issued, into=self._into(work, shard, buffer))
            except EpochMoved:
                work.copies.clear()  # the abandoned collective may still write them
                return rec.EpochChanged(self.coord.chain_after(epoch))
            except CollectiveError as e:
                work.copies.clear()
                if "remote=[" in str(e) or "remote=[" not in self.last_failure:  # the last that names a peer
                    self.last_failure = str(e)  # what a group cut apart from its peers says as it leaves
                self.log.emit("reduce", step=step, replica=self.role.group, epoch=epoch, ok=False, error=str(e), **tag)
                return rec.ReduceFailed(epoch, str(e))
            results.append(result.tensor)
            self.log.emit("reduce", step=step, replica=self.role.group, epoch=epoch, ok=True,
                          seconds=round(result.seconds, 6), microbatches=list(held), **extra, **tag)
        work.reduced = results
        return rec.Reduced(epoch)
