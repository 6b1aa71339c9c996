"""Commit pipelining: an optimizer step taken before the commit decision is known, and its undo.

Owns: `Pipeline`, the step (at most one) that stepped ahead of its decision (`Pending`): when a step may
step ahead, settling it once its decision is read (commit: nothing to do; retry: undo), and `Rollback`,
the copy of the parameters and the optimizer state taken just before a speculative optimizer step, put
back when the decision turns out to be retry. Does not own: the step's actions (trainer/step.py runs them,
also for a settled step) or the decision itself (membership.py).

Why: after the all-reduce every member but the last to publish waits for the commit decision: a
second synchronisation point each step that DDP does not have (its ranks part after the all-reduce).
Instead the optimizer steps at once and the next step computes; the decision is read before that step
reduces, by when it is there. Nothing leaves the process before the decision (no applied event, no
step record, no snapshot, no store write of the next step but its plan), so a retry, rare, only has
to restore memory: the copies are exact, so `--exact` stays bit for bit.

On 2 shared cores it takes the wait for a decision from ~3.4 ms to ~0.04 ms a step without moving
the step time measurably (benchmarks/overhead.py `--extras no-pipelining`; figures in
benchmarks/RESULTS.md): where replicas and the coordinator share cores, a waiting member's core goes
to a peer anyway. It pays on a cluster, where a waiting GPU idles and the store is a network hop away.
Stepping ahead must not also wait: the copy and the optimizer step would delay the proposer's
compare-and-set, which every peer waits on. The copy
costs a memcpy of the state each step, so `run.step_ahead="auto"` pipelines only states whose copy costs
well under the wait it hides (~3 ms measured here): up to `CPU_MAX_BYTES` in host memory (one thread
copied 8 MiB in 0.6 ms, 21 MiB in 2.3 ms, 64 MiB in 7.7 ms on this machine; a 1.8M-parameter GPT's
21 MiB copy was 2% of its replica's step), `MAX_BYTES` on an accelerator (64 MiB of HBM copies in
well under 0.1 ms); "on" any size.
"""
from __future__ import annotations

import copy
import operator
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from unbroken.events import EventLog
from unbroken.policy import recovery as rec
from unbroken.runtime.trainer.stepwork import StepWork

MAX_BYTES = 64 << 20  # parameters + optimizer state on an accelerator
CPU_MAX_BYTES = 8 << 20  # in host memory: ~0.6 ms to copy with one thread
# Neither is a config key: they define run.step_ahead="auto" (a copy well under the wait it hides, on
# either device); a run that wants another size says "on" or "off".


def limit(mode: str, device: torch.device | str = "cpu") -> int:
    """The largest state (parameters + optimizer state, bytes) to step ahead with under
    `run.step_ahead` = mode, for a state on `device`: "auto" CPU_MAX_BYTES on the CPU, MAX_BYTES
    elsewhere; "on" any; "off" none."""
    auto = CPU_MAX_BYTES if torch.device(device).type == "cpu" else MAX_BYTES
    return {"auto": auto, "on": 1 << 62, "off": -1}[mode]


class Rollback:
    """`save()` right before a speculative optimizer step, then `drop()` on commit or `restore()` on
    retry. One saved state at a time; `restore` without `save` raises RuntimeError.

    The copies live in buffers kept from step to step and are filled by one `_foreach_copy_`: cloning
    each tensor (28 parameters x 3 for a 2-layer GPT under AdamW) cost ~0.46 ms a step in allocation
    and dispatch alone, more than the bytes (1.4 MB) take to copy."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_bytes: int = MAX_BYTES):
        self.params, self.optimizer, self.max_bytes = params, optimizer, max_bytes  # see `limit`
        self._bytes: int | None = None  # known once every parameter has optimizer state (after a step)
        self._saved = False
        self._layout: tuple = ()  # what the buffers were shaped for: (param index, key, shape, dtype)...
        self._buffers: list[torch.Tensor] = []  # parameters first, then each state tensor, as _sources
        self._sources: list[torch.Tensor] = []  # what `save` copies into `_buffers`
        self._values: list[object] = []  # the optimizer state's values when `_plan` last ran
        self._others: list[tuple[nn.Parameter, str, object]] = []  # its non-tensor values (an int step)
        self._state: dict[nn.Parameter, dict] = {}  # per parameter with state: key -> saved value

    def affordable(self) -> bool:
        """Whether to step ahead this step: the state (parameters and optimizer state) is small enough
        to copy every step. Called every step: the size is summed until the optimizer state is
        complete, then kept."""
        if self.max_bytes < 0:
            return False
        if self._bytes is not None:
            return self._bytes <= self.max_bytes
        n = sum(p.numel() * p.element_size() for p in self.params)
        n += sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                 for v in s.values() if isinstance(v, torch.Tensor))
        if all(p in self.optimizer.state for p in self.params):
            self._bytes = n
        return n <= self.max_bytes

    def save(self) -> None:
        # An optimizer may replace its state's values instead of updating them in place (torch's
        # update theirs in place): the copy's plan is rebuilt whenever any value is another object
        # than last time. Rebuilding it (layouts, ~84 entries) cost ~150 us a step; checking ~15 us.
        state = self.optimizer.state
        values = [v for p in self.params if p in state for v in state[p].values()]
        if not self._buffers or len(values) != len(self._values) or not all(map(operator.is_, values,
                                                                                 self._values)):
            self._plan(state)
            self._values = values
        with torch.no_grad():
            torch._foreach_copy_(self._buffers, self._sources)
        for p, k, v in self._others:  # copied afresh: one may be mutable and changed in place
            self._state[p][k] = copy.deepcopy(v)
        self._saved = True

    def _plan(self, state: dict) -> None:
        """What `save` copies from where: `_sources` into `_buffers` (kept while the shapes stay),
        and `_state`, the saved optimizer state that refers to them."""
        entries = [(i, k, v) for i, p in enumerate(self.params) if p in state for k, v in state[p].items()]
        tensors = [(i, k, v) for i, k, v in entries if isinstance(v, torch.Tensor)]
        self._sources = [p.detach() for p in self.params] + [v for _, _, v in tensors]
        layout = tuple((i, k, v.shape, v.dtype, v.device) for i, k, v in tensors)
        if layout != self._layout or not self._buffers:
            self._buffers = [torch.empty_like(t) for t in self._sources]
            self._layout = layout
        saved = iter(self._buffers[len(self.params):])
        self._state = {}
        for i, k, v in entries:
            self._state.setdefault(self.params[i], {})[k] = next(saved) if isinstance(v, torch.Tensor) else None
        self._others = [(self.params[i], k, v) for i, k, v in entries if not isinstance(v, torch.Tensor)]

    @property
    def saved(self) -> bool:
        """A copy is held: taken by `save`, not yet dropped or restored. The caller drops it whenever
        the state changes otherwise (a copy may be taken early, e.g. while an all-reduce runs)."""
        return self._saved

    def drop(self) -> None:
        self._saved = False

    def restore(self) -> None:
        if not self._saved:
            raise RuntimeError("nothing saved to restore")
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self._buffers[:len(self.params)])
        for p in self.params:  # the saved copies become the state again (before step 0: no state)
            if p in self._state:
                self.optimizer.state[p] = self._state[p]
            else:
                self.optimizer.state.pop(p, None)
        self._buffers, self._state, self._values = [], {}, []  # the state holds them: fresh buffers next
        self.drop()


@dataclass(frozen=True)
class Pending:
    """A step whose optimizer stepped ahead of its decision: `action` is the Publish the policy asked
    for, run on the sidecar in `published` (sidecar.publish: the count and, if we were last, the
    commit we compare-and-set)."""
    work: StepWork
    state: rec.StepState
    action: rec.Publish
    published: Future


class Steps(Protocol):
    """What reading a pending step's decision needs of the trainer: the same calls its own step makes."""

    def decided(self, work: StepWork, step: int, epoch: int, won) -> rec.Decided: ...

    def await_outcome(self, work: StepWork, step: int, epoch: int,
                      decision: bool) -> rec.Decided | rec.EpochChanged: ...


@dataclass(frozen=True)
class Settlement:
    """A pending step whose decision is read: the rest of its actions (its Apply on a commit; on a retry,
    its recovery to a commit) for the trainer to run, and whether it committed as it stepped."""
    work: StepWork
    state: rec.StepState
    actions: tuple[rec.Action, ...]
    committed: bool


class Pipeline:
    """At most one step stepped ahead of its decision. Per step: `can_step_ahead` where the policy says
    Publish; if so `step_ahead`; before anything of the next step leaves the process, `settle`."""

    def __init__(self, rollback: Rollback, log: EventLog, me: int):
        self.rollback, self.log, self.me = rollback, log, me
        self.pending: Pending | None = None  # a step stepped ahead, its decision not yet read
        self._ahead: tuple[int, int, float] | None = None  # (step, epoch, loss) stepped before its decision

    def can_step_ahead(self, action: rec.Action) -> bool:
        """Pipeline this step's publish and decision: only while no other step is pending, and when the
        state is small enough to copy each step (Rollback.affordable)."""
        return isinstance(action, rec.Publish) and self.pending is None and self.rollback.affordable()

    def save_early(self) -> None:
        """Take the copy a step ahead would need now, while a collective runs (off the path), if it may."""
        if self.pending is None and not self.rollback.saved and self.rollback.affordable():
            self.rollback.save()

    def step_ahead(self, work: StepWork, state: rec.StepState, action: rec.Publish, published: Future,
                   step_optimizer: Callable[[], float]) -> None:
        """The optimizer step before the decision (memory only, undone on retry); `published` is the
        sidecar's publish of `action`, already under way."""
        if not self.rollback.saved:  # usually saved during the all-reduce (save_early)
            self.rollback.save()
        self._ahead = (action.step, action.epoch, step_optimizer())
        self.pending = Pending(work, state, action, published)

    def loss_ahead(self, step: int, epoch: int) -> float | None:
        """The loss of (step, epoch) if its optimizer stepped ahead (taken: call once, at its Apply)."""
        if self._ahead is not None and self._ahead[:2] == (step, epoch):
            loss, self._ahead = self._ahead[2], None
            return loss
        return None

    def settle(self, steps: Steps) -> Settlement | None:
        """Read the pending step's decision; None when no step is pending. Call before anything of a
        later step leaves the process, and once after the last step; then run the settlement's actions.

        Commit: the rest is the step's events and record. Retry (or the epoch moved first): the optimizer
        step is undone here and the step goes on from its intact accumulator until it commits; the
        caller's step, computed on the undone parameters, must start over."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        work, state, step, epoch = pending.work, pending.state, pending.action.step, pending.action.epoch
        t = time.perf_counter()
        count, won = pending.published.result()
        work.waited += time.perf_counter() - t
        state, (action,) = rec.on_event(state, rec.Published(epoch, count))  # Propose commit or AwaitDecision
        if isinstance(action, rec.Propose):
            event = steps.decided(work, step, epoch, won)  # the sidecar compare-and-set it: ours, or a retry
        else:
            event = steps.await_outcome(work, step, epoch, decision=True)
        committed = event == rec.Decided(epoch, "commit")
        if not committed:
            self._undo(work, step, epoch)
        state, more = rec.on_event(state, event)
        return Settlement(work, state, more, committed)

    def _undo(self, work: StepWork, step: int, epoch: int) -> None:
        self.rollback.restore()
        work.acc.attach()  # the step goes on: backward must add into its buffer again
        self._ahead = None
        self.log.emit("undone", step=step, replica=self.me, epoch=epoch)
