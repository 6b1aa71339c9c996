"""The cross-replica all-reduce of a one-rank group's accumulator in buckets, overlapped with backward.

Owns: cutting an accumulator's flat buffer (numel + 1: the gradient, then the weighted loss) into buckets
of about `bucket_bytes` in reverse parameter order (`Layout`, DDP's rule: backward produces the last
parameters' gradients first), and one reduction of it (`BucketedReduce`): each bucket's reduction
(float32: a copy all-reduced; --exact: a reduce-scatter and a gather, point to point) is issued as soon
as its gradients are final and every bucket before it is issued, and `finish` issues the rest and waits
for all. Does not own: when gradients are final (the caller's post-accumulate-grad hooks call `ready`),
or what a failure means (the step's policy).

Invariant 2 holds bucket by bucket: a reduction writes only `into` and its scratch, never the buffer
(the exact path's sends read it), so a failure at any point leaves the buffer with this replica's whole
partial sum. Every member issues the same buckets in the same order (the layout is a function of the
parameters' shapes and dtype alone), whether a bucket went out during backward or at `finish`: gloo
pairs collectives by their order, and the exchanges' tags by (the group's reduction serial, bucket,
stage). Groups of several ranks (FSDP2, TP, PP) and NCCL groups keep one all-reduce of the whole
buffer (trainer/reduction.py decides).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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

    Without `ring` (float32) each bucket is copied into its slice of `into` and all-reduced there. With
    `ring` (--exact: `buffer` float64, `into` the float32 gradient the optimizer reads) a bucket is
    reduce-scattered in float64 and all-gathered in float32, by point-to-point exchanges: its gradient
    elements are cut into one chunk per member; each member sends chunk j of its buffer to member j
    and receives every other member's copy of its own chunk into a ring slot (no copy: the sends read
    the buffer, which nothing writes); it adds the parts in member order, rounds the float64 sum once
    into its chunk of `into`, and sends that float32 chunk to every other member, which receive theirs
    into `into` directly. The bucket's slot is free once its sum is taken, for the bucket len(ring)
    later. The loss element goes apart: a float64 all-reduce into `loss` (1,). Against a float64
    all-reduce of a copy rounded afterwards: a float32 all-gather (half the bytes), no copy of the
    bucket, and one pass of add-and-round over a chunk instead of a rounding pass over the bucket. The
    result is the same float64 sum rounded once: with two members, the same add."""

    def __init__(self, layout: Layout, group: EpochGroup, buffer: torch.Tensor, into: torch.Tensor,
                 moved: Callable[[], bool], ring: list[torch.Tensor] | None = None,
                 loss: torch.Tensor | None = None):
        self.layout, self.group, self.buffer, self.into, self.moved = layout, group, buffer, into, moved
        self.ring, self.loss = ring, loss
        self.final = [0] * len(layout.ranges)  # parameters final, per bucket
        self.issued: list[Issued] = []  # per bucket: its all-reduce, or (ring) its scatter's exchange
        self.gathers: list[Issued] = []  # ring: per bucket summed, its gather's exchange; the loss's
        self.parts: dict[int, list[torch.Tensor]] = {}  # ring: a scattered bucket's parts of this chunk
        self.serial = 0  # ring: the group's serial of this reduction, taken at its first bucket
        self.narrowed = 0  # with a ring: buckets summed and rounded into `into`, in order
        self.broken = False  # a bucket failed while backward went on: the rest waits for `finish`
        self.early = 0  # buckets issued before `finish`: during backward
        self.watch_every_s = 0.005

    @staticmethod
    def slot_elements(layout: Layout, members: int) -> int:
        """The float64 elements a ring slot needs for a group of `members`: the other members' parts of
        the largest chunk of any bucket."""
        return max((members - 1) * -(-(b - a) // members) for a, b in layout.ranges) or 1

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
            if self.ring is not None:
                self.issued.append(self._scatter(k))
                continue
            a, b = ranges[k]
            self.issued.append(self.group.issue(self.into[a:b].copy_(self.buffer[a:b])))

    def _chunks(self, k: int) -> list[int]:
        """Bucket k's gradient elements (its range less the loss element) cut into one chunk per
        member: member j's is [c[j], c[j + 1])."""
        a, b = self.layout.ranges[k]
        b -= b == self.buffer.numel()
        n, members = b - a, len(self.group.members)
        return [a + j * n // members for j in range(members + 1)]

    def _tag(self, k: int, stage: int) -> int:
        return ((self.serial * len(self.layout.ranges) + k) * 2 + stage) % (1 << 31)

    def _scatter(self, k: int) -> Issued:
        """Issue bucket k's reduce-scatter: chunk j of the buffer to member j, the others' parts of this
        member's chunk into the bucket's slot (and, for the bucket holding it, the loss's all-reduce)."""
        if k == 0:
            self.serial = self.group.take_serial()
        c, me = self._chunks(k), self.group.rank
        slot, size, at = self.ring[k % len(self.ring)], c[me + 1] - c[me], 0
        sends, recvs, parts = [], [], []
        for j in range(len(c) - 1):
            if j == me:
                parts.append(self.buffer[c[j]:c[j + 1]])
                continue
            if c[j + 1] > c[j]:
                sends.append((j, self.buffer[c[j]:c[j + 1]]))
            parts.append(slot[at:at + size])
            if size:
                recvs.append((j, parts[-1]))
            at += size
        self.parts[k] = parts
        if self.layout.ranges[k][1] == self.buffer.numel():
            self.gathers.append(self.group.issue(self.loss.copy_(self.buffer[-1:])))
        return self.group.exchange(self._tag(k, 0), sends, recvs)

    def _free(self, k: int, wait: bool) -> bool:
        """Whether bucket k's slot is free (always, without a ring): every bucket up to k - len(ring)
        summed and rounded into `into`. wait=False (in backward): only what has finished, False on a
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
        """Bucket k's parts are here: their float64 sum rounded into this member's chunk of `into`, then
        that chunk's all-gather issued."""
        c, me = self._chunks(k), self.group.rank
        mine = self.into[c[me]:c[me + 1]]
        add_rounded(self.parts.pop(k), mine, me)
        sends = [(j, mine) for j in range(len(c) - 1) if j != me and c[me + 1] > c[me]]
        recvs = [(j, self.into[c[j]:c[j + 1]]) for j in range(len(c) - 1) if j != me and c[j + 1] > c[j]]
        self.gathers.append(self.group.exchange(self._tag(k, 1), sends, recvs))
        self.narrowed = k + 1

    def _wait(self, one: Issued) -> None:
        try:
            self.group.wait([one], self.moved, self.watch_every_s)
        except BaseException:
            self.abandon()
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
            self.abandon()
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
            for one in self.gathers:
                self._wait(one)
            self.into[-1:].copy_(self.loss)  # `into` reads as the whole reduced buffer, rounded
        return ReduceResult(self.into, time.perf_counter() - t0)

    def abandon(self) -> None:
        """Walk away from the buckets issued so far (the step's reduction goes another way)."""
        self.group.abandon(self.issued + self.gathers)


def add_rounded(parts: list[torch.Tensor], out: torch.Tensor, own: int) -> None:
    """Sum float64 CPU `parts` (one per member, in member order; parts[own] is the buffer's, never
    written, the others scratch) and round the sum once into float32 `out`: (((p0 + p1) + p2) + ...) -> float32,
    the last add and the rounding in one pass (numpy on the CPU: float64 arithmetic, rounded to nearest
    even as it is stored, as `.to(float32)` rounds; a NaN stays a NaN, its sign the hardware's choice)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    *head, last = parts
    if head[1:]:  # three members or more: the head's sum in a received part, never the buffer's
        total = head[1] if own == 0 else head[0]
        torch.add(head[0], head[1], out=total)  # p0 + p1, operands in order (which NaN a NaN + NaN keeps)
        for p in head[2:]:
            total.add_(p)
    else:
        total = head[0]
    with np.errstate(all="ignore"):  # quiet, as torch: overflow to inf, inf - inf to NaN
        np.add(total.numpy(), last.numpy(), out=out.numpy(), casting="same_kind")
