"""Fault-tolerant cross-replica collectives: one real gloo group per membership epoch and shard index.

Owns: forming the epoch's group on a fresh store prefix, running an all-reduce on a *copy* of the caller's
buffer, point-to-point exchanges (`exchange`: --exact's bucketed reduce-scatter and gather, buckets.py),
and turning a dead peer, a timeout or a membership change into a typed outcome instead of a hang.
Does not own: deciding membership (coordinator) or what to do after a failure (policy.recovery).

Why this shape (measured, REFERENCE.md): when a peer dies mid-reduction some survivors get "connection
closed" at once while others stay blocked inside gloo until the group's timeout, and abort()/shutdown() do
not free a blocked all-reduce. So formation and the collective run asynchronously (formation in a daemon
thread, which releases the GIL; the collective as async Work), the caller waits on them while watching
the membership epoch, and abandons both when the epoch moves. Abandoned groups keep their threads and sockets;
we hold references so their destructors never run mid-operation; the process exits with os._exit.

This is the gloo group: CPU ranks, and CUDA ranks under parallel.cross_backend=gloo (gloo reduces CUDA
tensors by staging them through host memory). CUDA ranks reduce on NCCL by default (nccl.py: a
non-blocking communicator formed eagerly off the step's path, its completion polled, aborted from a
watcher thread when the epoch moves, a peer fails or the timeout passes; ncclmachine.py decides); gloo's
blocked all-reduce cannot be aborted, so an abandoned gloo group is kept instead (`keep`).
crossgroup.py chooses between them. Both return ReduceResult or raise CollectiveError / EpochMoved.
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from unbroken.runtime.store import keys


class CollectiveError(RuntimeError):
    """The collective failed (peer gone, timeout); the caller's buffer is intact."""


class EpochMoved(RuntimeError):
    """The membership moved past the group's epoch while we waited; the result must not be used."""


@dataclass(frozen=True)
class ReduceResult:
    tensor: torch.Tensor  # the reduced copy
    seconds: float  # wall time inside the collective, formation included


class EpochGroup:
    """The cross-replica group of one membership epoch (for one shard index; DP has one).

    Create one per epoch you reduce in; `allreduce` may be called many times while the epoch holds.
    """

    def __init__(self, store: Store, epoch: int, members: tuple[int, ...], me: int, timeout_s: float,
                 shard: int = 0):
        self.epoch, self.members, self.me = epoch, members, me
        self.rank = members.index(me)
        self._pg: dist.ProcessGroup | None = None
        self._serial = 0  # reductions that have issued point-to-point exchanges here (`take_serial`)
        self._exchanges: queue.SimpleQueue | None = None  # (Joined, Event) for the waiter thread
        self._error: BaseException | None = None
        prefix = PrefixStore(keys.collective_prefix(shard, epoch, tuple(members)), store)
        timeout = datetime.timedelta(seconds=timeout_s)

        def form() -> None:
            try:
                self._pg = dist.ProcessGroupGloo(prefix, self.rank, len(members), timeout)
            except BaseException as e:  # noqa: BLE001 - surfaced to the caller as CollectiveError
                self._error = e

        self._former = threading.Thread(target=form, name=f"form-epoch-{epoch}", daemon=True)
        self._former.start()

    def allreduce(self, buffer: torch.Tensor, moved: Callable[[], bool], watch_every_s: float = 0.005,
                  on_issued: Callable[[], None] | None = None, into: torch.Tensor | None = None) -> ReduceResult:
        """Sum `buffer` across the epoch's members into a copy; `buffer` itself is never written.

        The copy is `into` (same shape and dtype as `buffer`) when given, else a fresh clone. Reusing
        one saves the clone's allocation, whose page faults cost more than the copy (a fresh 7 MB
        buffer: ~3 ms). After EpochMoved or CollectiveError the caller must not reuse `into`: an
        abandoned collective may still write it.

        Waits are event-driven (the former thread's end, the work's future), woken at least every
        `watch_every_s` to ask `moved()`, which must be cheap (a local read, see EpochWatch); when it
        returns True the pending formation or work is abandoned and EpochMoved is raised. A failed
        collective raises CollectiveError. `on_issued` runs right after the collective is issued.
        """
        t0 = time.perf_counter()
        self.wait_formed(moved, watch_every_s)
        copy = buffer.clone() if into is None else into.copy_(buffer)
        issued = [self.issue(copy)]
        if on_issued is not None:
            on_issued()
        self.wait(issued, moved, watch_every_s)
        return ReduceResult(copy, time.perf_counter() - t0)

    @property
    def formed(self) -> bool:
        """Whether the group has formed (a local read): `issue` needs it."""
        return self._pg is not None

    def wait_formed(self, moved: Callable[[], bool], watch_every_s: float = 0.005) -> None:
        """Return once the group formed; raises CollectiveError if formation failed, EpochMoved if
        `moved()` turned True first (the formation is abandoned)."""
        while self._pg is None:
            if self._error is not None:
                raise CollectiveError(f"epoch {self.epoch} group did not form: {self._error}")
            self._former.join(watch_every_s)
            if self._pg is None and self._error is None and moved():
                raise EpochMoved(f"epoch {self.epoch} ended while its group formed")

    def issue(self, copy: torch.Tensor) -> Issued:
        """Start an all-reduce (sum) of `copy` in place, asynchronously; the group must be `formed`.
        Members must issue the same sequence of sizes in the same order (gloo pairs them by order)."""
        work = self._pg.allreduce([copy])
        finished = threading.Event()
        # Runs on gloo's thread when the work completes or fails; the GIL-free Event.wait below wakes.
        work.get_future().add_done_callback(lambda _: finished.set())
        return Issued(work, finished, copy)

    def take_serial(self) -> int:
        """This group's count of reductions so far, then one more: call once per reduction, at its first
        collective. Every member issues the same collectives in the same order (gloo pairs them so), so
        the k-th reduction has serial k on each member: its exchanges' tags derive from it."""
        self._serial += 1
        return self._serial - 1

    def exchange(self, tag: int, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]]) -> Issued:
        """Send each tensor to its member (a rank of this group) and receive each into its tensor, all
        asynchronously, as one `Issued`; the group must be `formed`. `tag` (0 <= tag < 2**31) pairs a
        member's sends with its peers' receives: both sides must name the same tag, each tag used once.
        gloo's point-to-point works have no future and may be waited once: a waiter thread per group
        waits them in issue order, keeps the first failure for `Issued.work.wait()` to raise, and sets
        `finished`. A dead peer fails them at once (at issue, where its pair is closed already); a silent
        one after the group's timeout. Never raises a collective's failure: `wait` does."""
        works, failed = [], None
        try:
            works += [self._pg.send([t], peer, tag) for peer, t in sends]
            works += [self._pg.recv([t], peer, tag) for peer, t in recvs]
        except RuntimeError as e:  # a pair already closed fails at issue: the same outcome, later
            failed = e
        one = Issued(Joined(works), threading.Event(), tuple(t for _, t in sends + recvs))
        if failed is not None:
            one.work.error = failed
            one.finished.set()
            return one
        if self._exchanges is None:
            self._exchanges = queue.SimpleQueue()
            threading.Thread(target=_wait_exchanges, args=(self._exchanges,), daemon=True,
                             name=f"exchange-epoch-{self.epoch}").start()
            weakref.finalize(self, self._exchanges.put, None)  # the group dropped: the thread ends
        self._exchanges.put(one)
        return one

    def wait(self, issued: list[Issued], moved: Callable[[], bool], watch_every_s: float = 0.005) -> None:
        """Wait for every issued all-reduce, in order. Raises EpochMoved when `moved()` turns True first
        (every one of them is abandoned, kept alive with the group) and CollectiveError when one failed."""
        for one in issued:
            while not one.finished.wait(watch_every_s):
                if moved():
                    self.abandon(issued)
                    raise EpochMoved(f"epoch {self.epoch} ended during the all-reduce")
            try:
                one.work.wait()
            except RuntimeError as e:
                self.abandon(issued)  # the others may still be in flight against a dead peer
                raise CollectiveError(f"all-reduce in epoch {self.epoch} failed: "
                                      f"{str(e).splitlines()[0][:160]}") from None

    def abandon(self, issued: list[Issued]) -> None:
        """Walk away from `issued` works (still running or never waited): they and the group stay alive
        for the process's life, so no destructor blocks on a dead peer."""
        _ABANDONED.extend((self._pg, one.work, one.copy) for one in issued)


@dataclass(frozen=True)
class Issued:
    """A collective in flight: its gloo work (`Joined` for an exchange), the event its completion sets,
    the tensor(s) it reads or writes (kept alive with it when abandoned)."""
    work: object
    finished: threading.Event
    copy: torch.Tensor | tuple[torch.Tensor, ...]


class Joined:
    """An exchange's point-to-point works as one work: `wait()` returns once the waiter thread saw them
    all through, or raises the first failure it saw (RuntimeError, as gloo's own `wait`)."""

    def __init__(self, works: list):
        self.works = works
        self.error: RuntimeError | None = None

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


def _wait_exchanges(exchanges: queue.SimpleQueue) -> None:
    """A group's waiter thread: waits each exchange's works in issue order (gloo's wait releases the GIL)
    and sets its `finished`; after a failure the rest of that exchange is left to the group's fate."""
    while (one := exchanges.get()) is not None:
        for work in one.work.works:
            try:
                work.wait()
            except RuntimeError as e:
                one.work.error = e
                break
        one.finished.set()


# Groups and works we walked away from: kept alive so no destructor blocks on a dead peer.
_ABANDONED: list[object] = []


def keep(groups) -> None:
    """Keep `groups` (EpochGroups a rank is done with: a shrunk group's survivor dropping its old trainer)
    alive for the process's life, as abandoned ones are: a gloo group destroyed while a peer still holds
    its end runs its destructor against that peer (seen: a donor silent past the heartbeat timeout right
    after the survivor let its old trainer go). Their memory is sockets and threads, not model state."""
    _ABANDONED.extend(groups)
