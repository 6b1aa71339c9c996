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
    `moved` is the epoch watch's cheap read.

    With `ring` (--exact: `buffer` float64, `into` the float32 gradient the optimizer reads), each bucket
    is copied into one of the ring's float64 slots (each as long as the longest bucket) and reduced
    there, then rounded into its slice of `into`, its slot free for the bucket len(ring) later; the
    reduced float64 loss element goes to `loss` (1,). So the copy the reduction works on is len(ring)
    buckets, not the whole float64 buffer, and no float32 gradient is made apart from `into`: rounding
    a slice is the same float64 -> float32 rounding as rounding the whole."""

    def __init__(self, layout: Layout, group: EpochGroup, buffer: torch.Tensor, into: torch.Tensor,
                 moved: Callable[[], bool], ring: list[torch.Tensor] | None = None,
                 loss: torch.Tensor | None = None):
        self.layout, self.group, self.buffer, self.into, self.moved = layout, group, buffer, into, moved
        self.ring, self.loss = ring, loss
        self.final = [0] * len(layout.ranges)  # parameters final, per bucket
        self.issued: list[Issued] = []
        self.narrowed = 0  # with a ring: buckets reduced and rounded into `into`, in order
        self.broken = False  # a bucket failed while backward went on: the rest waits for `finish`
        self.early = 0  # buckets issued before `finish`: during backward
        self.watch_every_s = 0.005

    def ready(self, i: int) -> bool:
        """Parameter i's slice is final; issue every bucket now complete whose predecessors are issued
        (and, with a ring, whose slot is free). Returns whether this call issued any (the caller's fault
        point: the first one out). Never raises a collective's failure: `finish` does."""
        self.final[self.layout.of[i]] += 1
        before = len(self.issued)
        if self.group.formed and not self.broken and not self.moved():  # else everything goes at `finish`
            self._issue(all_=False)
        self.early = len(self.issued)
        return len(self.issued) > before

    def _issue(self, all_: bool) -> None:
        ranges, count = self.layout.ranges, self.layout.count
        while len(self.issued) < len(ranges) and (all_ or self.final[len(self.issued)] >= count[len(self.issued)]):
            k = len(self.issued)
            if not self._free(k, wait=all_):
                return
            a, b = ranges[k]
            copy = self.into[a:b] if self.ring is None else self.ring[k % len(self.ring)][:b - a]
            self.issued.append(self.group.issue(copy.copy_(self.buffer[a:b])))

    def _free(self, k: int, wait: bool) -> bool:
        """Whether bucket k's slot is free (always, without a ring): every bucket up to k - len(ring)
        reduced and rounded into `into`. wait=False (in backward): only what has finished, False on a
        failure (kept for `finish` to raise); wait=True: waits, raising as EpochGroup.wait."""
        if self.ring is None:
            return True
        while self.narrowed <= k - len(self.ring):
            one = self.issued[self.narrowed]
            if wait:
                self._wait(one)
            elif not one.finished.is_set():
                return False
            else:
                try:
                    one.work.wait()  # finished: returns at once, or raises its failure
                except RuntimeError:
                    self.broken = True
                    return False
            self._narrow(self.narrowed)
        return True

    def _narrow(self, k: int) -> None:
        a, b = self.layout.ranges[k]
        slot = self.ring[k % len(self.ring)][:b - a]
        if b == self.buffer.numel():  # the bucket holding the loss element: kept in float64
            self.loss.copy_(slot[-1:])
        self.into[a:b].copy_(slot)
        self.narrowed = k + 1

    def _wait(self, one: Issued) -> None:
        try:
            self.group.wait([one], self.moved, self.watch_every_s)
        except BaseException:
            self.group.abandon(self.issued)
            raise

    def finish(self, on_issued: Callable[[], None] | None = None, watch_every_s: float = 0.005) -> ReduceResult:
        """Issue what is left (the group formed first), run `on_issued`, wait for every bucket. Raises
        EpochMoved (every bucket abandoned) or CollectiveError as EpochGroup.allreduce; either way
        `into` (and the ring) must not be reused, and `buffer` is intact. `seconds`: from this call to
        the end, what backward did not hide, formation included."""
        t0 = time.perf_counter()
        self.watch_every_s = watch_every_s
        try:
            self.group.wait_formed(self.moved, watch_every_s)
        except BaseException:
            self.group.abandon(self.issued)
            raise
        self._issue(all_=True)
        if on_issued is not None:
            on_issued()
        if self.ring is None:
            self.group.wait(self.issued, self.moved, watch_every_s)
        else:
            while self.narrowed < len(self.issued):
                self._wait(self.issued[self.narrowed])
                self._narrow(self.narrowed)
        return ReduceResult(self.into, time.perf_counter() - t0)

    def abandon(self) -> None:
        """Walk away from the buckets issued so far (the step's reduction goes another way)."""
        self.group.abandon(self.issued)
