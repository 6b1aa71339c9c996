"""Healing a joiner: the training state of one rank sent from a live donor group to a restarted or new one.

Owns: the state a joiner needs (parameters and optimizer state: this rank's shards of them under FSDP2),
flattened into one buffer; the two-rank gloo group (donor's rank j, joiner's rank j, on a store prefix of
the admission) that broadcasts it; and the joiner's check that what it loaded hashes to the donor's
parameter digest. Does not own: when to heal or who donates (policy.membership; the trainer calls `donate`
after applying the step before the joiner's first, the worker calls `receive` before training), or the
RNG and data position: both are functions of (seed, step, microbatch) here, so the step number carries them.

Why one buffer: a broadcast per tensor (28 parameters + 56 optimizer tensors for a 2-layer GPT) costs a
gloo round trip each; one flat float32 buffer is one (REFERENCE.md measured 7-15 ms for 6 MiB).
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
    seconds of the transfer alone: the group's rendezvous excluded). `shard()`: (parameters, tensors to
    send, _) of one shard index when this rank holds several (standin.heal_tensors), else all of `model`'s.
    Call right
    after the optimizer step of the step before the joiner's first. Raises on a joiner that never
    comes (timeout, or at once when `gone()` says so: Forming.get) or dies mid-transfer: the caller
    goes on, and the joiner is declared dead."""
    t0 = time.perf_counter()
    pg = forming.get(gone)
    params, tensors, _ = shard() if shard else _whole(model, optimizer)
    # on the host: the heal group is gloo, and AdamW's `step` is a CPU scalar beside a GPU's CUDA moments
    flat = torch.cat([t.reshape(-1).to("cpu", torch.float32) for t in tensors])
    digest = torch.tensor(list(bytes.fromhex(param_digest(params))), dtype=torch.uint8)
    pg.barrier().wait()  # the group formed on both sides: what follows is the transfer
    t1 = time.perf_counter()
    pg.broadcast(flat, 0).wait()
    pg.broadcast(digest, 0).wait()
    t2 = time.perf_counter()
    return flat.numel() * flat.element_size(), t2 - t0, t2 - t1


class HealMismatch(RuntimeError):
    """What the joiner loaded does not hash to the donor's digest."""


def receive(forming: Forming, model: nn.Module, optimizer: torch.optim.Optimizer,
            shard: Shard | None = None) -> tuple[int, float, float]:
    """Load this rank's state (or one shard index of it, as `donate`: its tensors filled, then put back
    into the whole model) from the donor's rank over the heal group; returns (bytes, seconds in all,
    seconds of the transfer alone). Call once, before the first step (after `materialize`, which a fresh
    optimizer needs to have state tensors to load into: done before waiting, off the donor's path).
    Raises HealMismatch when the loaded parameters do not hash to the donor's
    digest, and gloo's error when the donor dies mid-transfer."""
    t0 = time.perf_counter()
    materialize(model, optimizer)  # a no-op when done already
    pg = forming.get()
    params, tensors, put_back = shard() if shard else _whole(model, optimizer)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    digest = torch.empty(16, dtype=torch.uint8)
    pg.barrier().wait()
    t1 = time.perf_counter()
    pg.broadcast(flat, 0).wait()
    pg.broadcast(digest, 0).wait()
    t2 = time.perf_counter()
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
    put_back()
    want, got = bytes(digest.tolist()).hex(), param_digest(params)
    if got != want:
        raise HealMismatch(f"healed parameters hash to {got}, the donor's to {want}")
    return flat.numel() * flat.element_size(), time.perf_counter() - t0, t2 - t1
