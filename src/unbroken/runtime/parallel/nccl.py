"""The cross-replica all-reduce on NCCL: one non-blocking communicator per (membership epoch, shard index).

Owns: `NcclEpochGroup`, EpochGroup's interface (collectives.py) on NCCL for CUDA tensors, and `TorchNccl`,
the adapter of torch's ProcessGroupNCCL to ncclmachine.Backend. Does not own: the decisions (when a
communicator is formed, a reduction done, or the communicator aborted: ncclmachine.py), which class a
rank uses (crossgroup.py), membership, or the gloo groups of CPU tensors.

torchft's pattern (REFERENCE.md, "GPUs"): the communicator is created non-blocking
(`Options().config.blocking = False`) and connected eagerly for this rank's device
(`eager_connect_single_device`), in a daemon thread on a fresh store prefix per (epoch, shard, members),
so it forms off the step's path; its per-operation timeout is set far beyond any step, so torch's
watchdog never ends an operation the machine is still watching (and TORCH_NCCL_ASYNC_ERROR_HANDLING=2,
device.nccl_environment, makes an error the watchdog does see abort the communicator, never the
process); completion is polled (`work.is_completed()`, which queries the work's CUDA event); an abort runs
on a watcher thread of its own, never on a thread inside an NCCL call. The all-reduce writes a copy of the
accumulator; after an abort that copy's content is undefined and discarded.

Never run: this module needs a CUDA build of torch and a GPU; the suite drives the machine against a fake
backend (tests/runtime/parallel/test_nccl_machine.py) and benchmarks/gpu_check.sh runs it on a GPU.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed import PrefixStore, Store

from unbroken.runtime.parallel.collectives import CollectiveError, EpochMoved, ReduceResult, keep
from unbroken.runtime.parallel.ncclmachine import Phase, ReductionMachine
from unbroken.runtime.store import keys

# Beyond any step: the machine enforces the group's timeout itself, by abort.
_NO_OP_TIMEOUT = datetime.timedelta(days=7)


def on_watcher(abort: Callable[[], None]) -> None:
    """Run `abort` on a daemon thread of its own (NVRx and torchft do the same): the caller goes on to
    report the failure while NCCL tears the communicator down, and no thread inside an NCCL call runs it."""
    threading.Thread(target=abort, name="nccl-abort", daemon=True).start()


class TorchNccl:
    """ncclmachine.Backend over a ProcessGroupNCCL of `size` ranks, formed on `store` in a daemon thread.
    Construct on the rank's bound CUDA device (device.bind), after device.nccl_environment."""

    def __init__(self, store: Store, rank: int, size: int, device: torch.device):
        self.pg = None
        self.work = None
        self._formed = threading.Event()
        self._error: str | None = None
        self._former = threading.Thread(target=self._form, args=(store, rank, size, device),
                                         name="form-nccl", daemon=True)
        self._former.start()

    def _form(self, store: Store, rank: int, size: int, device: torch.device) -> None:
        try:
            from torch.distributed import ProcessGroupNCCL

            torch.cuda.set_device(device)  # the current device is per thread: this one's is NCCL's
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", "600")  # torchft's: init may take long
            opts = ProcessGroupNCCL.Options()
            opts.config.blocking = False
            opts._timeout = _NO_OP_TIMEOUT
            pg = ProcessGroupNCCL(store, rank, size, opts)
            self.pg = pg  # visible before the connect, so an abort reaches a half-formed communicator
            if hasattr(pg, "_set_sequence_number_for_group"):
                pg._set_sequence_number_for_group()
            pg.eager_connect_single_device(device)
            self._formed.set()
        except BaseException as e:  # noqa: BLE001 - the machine turns it into CollectiveError
            self._error = str(e).splitlines()[0][:160] if str(e) else type(e).__name__

    def wait_formed(self, seconds: float) -> None:
        """Block up to `seconds` for formation to end (well or not); the caller's idle wait."""
        self._former.join(seconds)

    def formed(self) -> bool:
        return self._formed.is_set()

    def formation_error(self) -> str | None:
        return self._error

    def issue(self, copy: torch.Tensor) -> None:
        self.work = self.pg.allreduce([copy])

    def completed(self) -> bool:
        return self.work.is_completed()

    def error(self) -> str | None:
        try:
            self.work.wait()  # completed: returns at once, or raises the collective's error
        except RuntimeError as e:
            return str(e).splitlines()[0][:160]
        return None

    def abort(self) -> None:
        pg = self.pg
        if pg is not None:
            pg.abort()


class NcclEpochGroup:
    """The cross-replica group of one membership epoch and shard index on NCCL: EpochGroup's contract
    (collectives.py), for buffers on this rank's CUDA device. Create one per epoch; `allreduce` may be
    called many times while the epoch holds; after a CollectiveError the group is spent."""

    def __init__(self, store: Store, epoch: int, members: tuple[int, ...], me: int, timeout_s: float,
                 shard: int = 0, device: torch.device | None = None,
                 backend: Callable[[Store, int, int], object] | None = None,
                 abort_with: Callable[[Callable[[], None]], None] = on_watcher):
        self.epoch, self.members, self.me = epoch, members, me
        self.rank = members.index(me)
        prefix = PrefixStore(keys.collective_prefix(shard, epoch, tuple(members)) + "nccl/", store)
        make = backend or (lambda s, r, n: TorchNccl(s, r, n, device or torch.device("cuda")))
        self.backend = make(prefix, self.rank, len(members))
        self.machine = ReductionMachine(self.backend, timeout_s, time.monotonic(), abort_with)

    def allreduce(self, buffer: torch.Tensor, moved: Callable[[], bool], watch_every_s: float = 0.005,
                  on_issued: Callable[[], None] | None = None, into: torch.Tensor | None = None) -> ReduceResult:
        """EpochGroup.allreduce's contract: sum `buffer` across the members into a copy (`into` when
        given), `buffer` never written; EpochMoved when `moved()` turns True first, CollectiveError when
        the collective fails or times out. Either way the communicator is aborted (on a watcher thread)
        and the copy must not be used. Completion is polled every ~0.1 ms (a CUDA event query)."""
        t0 = time.perf_counter()
        m = self.machine
        while m.formation(moved(), time.monotonic()) is Phase.FORMING:
            wait = getattr(self.backend, "wait_formed", None)
            wait(watch_every_s) if wait else time.sleep(watch_every_s)
        self._raise(m)
        copy = buffer.clone() if into is None else into.copy_(buffer)
        m.issue(copy, time.monotonic())
        if on_issued is not None:
            on_issued()
        while m.poll(moved(), time.monotonic()) is Phase.REDUCING:
            time.sleep(0.0001)
        self._raise(m, copy)
        return ReduceResult(copy, time.perf_counter() - t0)

    def _raise(self, m: ReductionMachine, copy: torch.Tensor | None = None) -> None:
        if m.phase is not Phase.ABORTED:
            return
        keep([(self.backend, copy)])  # an aborted collective may still write the copy
        f = m.failure
        what = f"epoch {self.epoch} NCCL all-reduce: {f.reason}"
        raise EpochMoved(what) if f.moved else CollectiveError(what)
