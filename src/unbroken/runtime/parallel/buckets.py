"""The cross-replica all-reduce of a one-rank group's accumulator in buckets, overlapped with backward.

Owns: cutting an accumulator's flat buffer (numel + 1: the gradient, then the weighted loss) into buckets
of about `bucket_bytes` in reverse parameter order (`Layout`, DDP's rule: backward produces the last
parameters' gradients first), and one reduction of it (`BucketedReduce`): each bucket is copied out of
the buffer and its all-reduce issued as soon as its gradients are final and every bucket before it is
issued, and `finish` issues the rest and waits for all. Does not own: when gradients are final (the
caller's post-accumulate-grad hooks call `ready`), or what a failure means (the step's policy).

Invariant 2 holds bucket by bucket: every all-reduce writes only its slice of the copy (`into`), never
the buffer, so a failure at any point leaves the buffer with this replica's whole partial sum. Every
member issues the same buckets in the same order (the layout is a function of the parameters' shapes
and dtype alone), whether a bucket went out during backward or at `finish`: gloo pairs collectives by
their order. Groups of several ranks (FSDP2, TP, PP) and NCCL groups keep one all-reduce of the whole
buffer (trainer/reduction.py decides).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from unbroken.runtime.parallel.collectives import EpochGroup, Issued, ReduceResult

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Layout:
    """Buckets over a flat buffer of parameters laid out in order (offsets, sizes) plus one trailing
    loss element. Bucket 0 holds the last parameters and the loss; bucket k, the k-th group of
    parameters counted from the end. `ranges[k]` = (start, end) in the buffer; `of[i]`: parameter i's
    bucket; `count[k]`: its parameters."""
    ranges: tuple[tuple[int, int], ...]
    of: tuple[int, ...]
    count: tuple[int, ...]

    @staticmethod
    def of_sizes(sizes: list[int], element_bytes: int, bucket_bytes: int = BUCKET_BYTES) -> Layout:
        """The layout for parameters of `sizes` elements each (in buffer order), each bucket at least
        one parameter and at most about `bucket_bytes`, a parameter never split."""
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        end = sum(sizes) + 1  # the loss element goes with the last parameters
        ranges, of, count = [], [0] * len(sizes), []
        i = len(sizes) - 1
        while i >= 0:
            start, n = offsets[i], 0
            while i >= 0 and (n == 0 or (end - offsets[i]) * element_bytes <= bucket_bytes):
                start, of[i], n, i = offsets[i], len(ranges), n + 1, i - 1
            ranges.append((start, end))
            count.append(n)
            end = start
        if not sizes:
            ranges, count = [(0, 1)], [0]
        return Layout(tuple(ranges), tuple(of), tuple(count))


class BucketedReduce:
    """One all-reduce of `buffer` into `into` over `group`, bucket by bucket. Call `ready(i)` as parameter
    i's part of the buffer is final (from a hook, any thread holding the GIL), then `finish` once.
    `moved` is the epoch watch's cheap read."""

    def __init__(self, layout: Layout, group: EpochGroup, buffer: torch.Tensor, into: torch.Tensor,
                 moved: Callable[[], bool]):
        self.layout, self.group, self.buffer, self.into, self.moved = layout, group, buffer, into, moved
        self.final = [0] * len(layout.ranges)  # parameters final, per bucket
        self.issued: list[Issued] = []
        self.early = 0  # buckets issued before `finish`: during backward
        self.t0 = time.perf_counter()

    def ready(self, i: int) -> bool:
        """Parameter i's slice is final; issue every bucket now complete whose predecessors are issued.
        Returns whether this call issued any (the caller's fault point: the first one out)."""
        self.final[self.layout.of[i]] += 1
        before = len(self.issued)
        if self.group.formed and not self.moved():  # else everything goes at `finish`
            self._issue(all_=False)
        self.early = len(self.issued)
        return len(self.issued) > before

    def _issue(self, all_: bool) -> None:
        ranges, count = self.layout.ranges, self.layout.count
        while len(self.issued) < len(ranges) and (all_ or self.final[len(self.issued)] >= count[len(self.issued)]):
            a, b = ranges[len(self.issued)]
            self.issued.append(self.group.issue(self.into[a:b].copy_(self.buffer[a:b])))

    def finish(self, on_issued: Callable[[], None] | None = None, watch_every_s: float = 0.005) -> ReduceResult:
        """Issue what is left (the group formed first), run `on_issued`, wait for every bucket. Raises
        EpochMoved (every bucket abandoned) or CollectiveError as EpochGroup.allreduce; either way
        `into` must not be reused, and `buffer` is intact. `seconds`: from this call to the end, what
        backward did not hide, formation included."""
        t0 = time.perf_counter()
        try:
            self.group.wait_formed(self.moved, watch_every_s)
        except BaseException:
            self.group.abandon(self.issued)
            raise
        self._issue(all_=True)
        if on_issued is not None:
            on_issued()
        self.group.wait(self.issued, self.moved, watch_every_s)
        return ReduceResult(self.into, time.perf_counter() - t0)

    def abandon(self) -> None:
        """Walk away from the buckets issued so far (the step's reduction goes another way)."""
        self.group.abandon(self.issued)
