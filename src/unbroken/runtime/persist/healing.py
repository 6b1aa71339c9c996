"""Healing a joiner: the training state of one rank sent from a live donor group to a restarted or new one.

Owns: the state a joiner needs (parameters and optimizer state: this rank's shards of them under FSDP2),
flattened into one buffer; the two-rank gloo group (donor's rank j, joiner's rank j, on a store prefix of
the admission) that broadcasts it; and the joiner's check that what it loaded hashes to the donor's
parameter digest. Does not own: when to heal or who donates (policy.membership; the trainer calls `donate`
after applying the step before the joiner's first, the worker calls `receive` before training), or the
RNG and data position: both are functions of (seed, step, microbatch) here, so the step number carries them.

Why buckets: a broadcast per tensor (28 parameters + 56 optimizer tensors for a 2-layer GPT) costs a
gloo round trip each (REFERENCE.md measured 7-15 ms for 6 MiB as one buffer); one flat buffer of the
whole state makes the donor copy all of it before the first byte leaves and the joiner receive all of
it before its first copy out. Flat float32 buckets of about BUCKET_BYTES (whole tensors) instead, all
posted at once: the donor flattens bucket k+1 while k is on the wire, the joiner copies bucket k into
its tensors while k+1 arrives, and no bucket waits for an acknowledgement of the one before.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import PrefixStore, Store

from unbroken.runtime.parallel.accumulator import local, param_digest, unique_parameters
from unbroken.runtime.persist.state import materialize


BUCKET_BYTES = 16 << 20


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of about BUCKET_BYTES as float32 (a tensor is never split);
    donor and joiner cut the same state the same way."""
    bucket_bytes = BUCKET_BYTES
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + 4 * t.numel() > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += 4 * t.numel()
    return out


def _tensors(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This shard's parameters, then each parameter's optimizer state tensors (sorted keys), all local."""
    out = [local(p.detach()) for p in params]
    for p in params:
        for _, v in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v):
                out.append(local(v))
    return out


def _whole(model: nn.Module, optimizer: torch.optim.Optimizer
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
    """A rank's own state: (its parameters, them and their optimizer state, nothing to put back)."""
    params = unique_parameters(model)
    return params, _tensors(params, optimizer), lambda: None


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A rank's own state as a heal sends it: its parameters, then their optimizer state (local shards)."""
    return _whole(model, optimizer)[1]


class Forming:
    """The two-rank heal group (donor rank 0, joiner rank 1) on `prefix`, formed on a thread of its own:
    the joiner starts forming it as soon as it is admitted, with the donor the policy will most likely
    pick, so that the donor, arriving at the step boundary, finds it waiting (the joiner's wake-up and
    connection were 0.36 s of the donor's held step, measured under load). `get` waits for it and raises
    what forming raised (a timeout when the other side never comes), or gives up early once `gone` says
    the other side will not come."""

    def __init__(self, store: Store, prefix: str, rank: int, timeout_s: float):
        self._pg: dist.ProcessGroup | None = None
        self._error: BaseException | None = None

        def form() -> None:
            try:
                self._pg = dist.ProcessGroupGloo(PrefixStore(prefix, store), rank, 2,
                                                 datetime.timedelta(seconds=timeout_s))
            except BaseException as e:  # noqa: BLE001 - raised by get()
                self._error = e

        self._thread = threading.Thread(target=form, name="heal-group", daemon=True)
        self._thread.start()

    def get(self, gone: Callable[[], bool] | None = None, poll_s: float = 0.2) -> dist.ProcessGroup:
        """The formed group. `gone()`, asked every `poll_s` s while it forms: True once the other side is
        known lost (a joiner declared dead, or re-admitted as a new incarnation), and this raises then,
        not after the whole timeout: a donor rank held 120 s by a joiner killed mid-heal stalled its own
        group's pipeline past gloo's 30 s (its peer rank had gone on to the next step). The forming
        thread is left to its timeout (a daemon; its group is never used)."""
        while self._thread.is_alive():
            self._thread.join(poll_s)
            if gone is not None and self._thread.is_alive() and gone():
                raise RuntimeError("the heal group did not form: the other side is gone")
        if self._pg is None:
            raise RuntimeError(f"the heal group did not form: {self._error}")
        return self._pg


Shard = Callable[[], tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]]


def donate(forming: Forming, model: nn.Module, optimizer: torch.optim.Optimizer,
           shard: Shard | None = None, gone: Callable[[], bool] | None = None) -> tuple[int, float, float]:
    """Send this rank's state to the joiner's rank over the heal group; returns (bytes, seconds in all,
    seconds of the transfer alone: the group's rendezvous excluded, the flattening, which overlaps it,
    included). `shard()`: (parameters, tensors to
    send, _) of one shard index when this rank holds several (standin.heal_tensors), else all of `model`'s.
    Call right
    after the optimizer step of the step before the joiner's first. Raises on a joiner that never
    comes (timeout, or at once when `gone()` says so: Forming.get) or dies mid-transfer: the caller
    goes on, and the joiner is declared dead."""
    t0 = time.perf_counter()
    pg = forming.get(gone)
    params, tensors, _ = shard() if shard else _whole(model, optimizer)
    digest = torch.tensor(list(bytes.fromhex(param_digest(params))), dtype=torch.uint8)
    pg.barrier().wait()  # the group formed on both sides: what follows is the transfer
    t1 = time.perf_counter()
    works, sent = [], 0
    for bucket in _buckets(tensors):  # flattened while the bucket before it is on the wire
        # on the host: the heal group is gloo, and AdamW's `step` is a CPU scalar beside a GPU's CUDA moments
        flat = torch.cat([t.reshape(-1).to("cpu", torch.float32) for t in bucket])
        works.append((pg.broadcast(flat, 0), flat))
        sent += flat.numel() * flat.element_size()
    works.append((pg.broadcast(digest, 0), digest))
    for work, _ in works:
        work.wait()
    t2 = time.perf_counter()
    return sent, t2 - t0, t2 - t1


class HealMismatch(RuntimeError):
    """What the joiner loaded does not hash to the donor's digest."""


def receive(forming: Forming, model: nn.Module, optimizer: torch.optim.Optimizer,
            shard: Shard | None = None) -> tuple[int, float, float]:
    """Load this rank's state (or one shard index of it, as `donate`: its tensors filled, then put back
    into the whole model) from the donor's rank over the heal group; returns (bytes, seconds in all,
    seconds of the transfer alone: from the barrier until the last bucket is in the tensors). Call
    once, before the first step (after `materialize`, which a fresh optimizer needs to have state
    tensors to load into: done before waiting, off the donor's path). Raises HealMismatch when the
    loaded parameters do not hash to the donor's digest, and gloo's error when the donor dies
    mid-transfer."""
    t0 = time.perf_counter()
    materialize(model, optimizer)  # a no-op when done already
    pg = forming.get()
    params, tensors, put_back = shard() if shard else _whole(model, optimizer)
    buckets = _buckets(tensors)
    flats = [torch.empty(sum(t.numel() for t in b), dtype=torch.float32) for b in buckets]
    digest = torch.empty(16, dtype=torch.uint8)
    pg.barrier().wait()
    t1 = time.perf_counter()
    works = [pg.broadcast(flat, 0) for flat in flats] + [pg.broadcast(digest, 0)]  # all posted: no round trips
    with torch.no_grad():
        for bucket, flat, work in zip(buckets, flats, works):  # bucket k copied out while k+1 arrives
            work.wait()
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
                offset += t.numel()
    works[-1].wait()
    t2 = time.perf_counter()
    put_back()
    want, got = bytes(digest.tolist()).hex(), param_digest(params)
    if got != want:
        raise HealMismatch(f"healed parameters hash to {got}, the donor's to {want}")
    return sum(f.numel() * f.element_size() for f in flats), time.perf_counter() - t0, t2 - t1
