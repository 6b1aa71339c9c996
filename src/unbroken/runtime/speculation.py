"""An optimizer step taken before the commit decision is known, and its undo.

Owns: a copy of the parameters and the optimizer state taken just before a speculative optimizer step,
and putting them back when the step's decision turns out to be retry. Does not own: when to speculate
(trainer.py: a member that has published its done record and waits for a peer's commit decision) or
the decision itself (coordination.py).

Why: after the all-reduce every member but the last to publish waits for the commit decision; on a
busy machine that wait (a store round trip or two plus the time to be scheduled again) is a few
milliseconds a step, and the optimizer step could run meanwhile. Nothing leaves the process before the
decision (no event, no store write, no snapshot), so a retry, rare, only has to restore memory: the
copies are exact, so `--exact` stays bit for bit. The copy costs a memcpy of the state, so speculation is
for states up to `MAX_BYTES` (where a step is short and the wait matters); larger ones wait as before.

It only pays where the wait leaves a core idle. Where replicas share cores (4 replicas on 2 here), a
waiting member's core goes to a peer anyway, and stepping ahead adds the copy and takes CPU from the
member that proposes the decision: in alternating runs of the overhead benchmark's workload (4 x 1
thread, 2 cores, 60 steps, 12 rounds) the step time with it was 1.055x (median of rounds; 11 of 12
rounds slower) the time without. So `run.step_ahead="auto"` turns it on only with a core per replica.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn

MAX_BYTES = 64 << 20  # parameters + optimizer state: ~0.3 ms to copy at memcpy speed


def wanted(mode: str, replicas: int, threads: int) -> bool:
    """Whether to step ahead under `run.step_ahead` = mode ("auto" | "on" | "off"), for `replicas` local
    replica processes of `threads` torch threads each. "auto": when this process may run on more cores
    than the replicas' threads take (one left for the coordinator, launcher and helper threads)."""
    if mode != "auto":
        return mode == "on"
    return len(os.sched_getaffinity(0)) > replicas * threads


class Rollback:
    """`save()` right before a speculative optimizer step, then `drop()` on commit or `restore()` on
    retry. One saved state at a time; `restore` without `save` raises RuntimeError.

    The copies live in buffers kept from step to step and are filled by one `_foreach_copy_`: cloning
    each tensor (28 parameters x 3 for a 2-layer GPT under AdamW) cost ~0.46 ms a step in allocation
    and dispatch alone, more than the bytes (1.4 MB) take to copy."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, enabled: bool = True):
        self.params, self.optimizer, self.enabled = params, optimizer, enabled  # enabled: see `wanted`
        self._bytes: int | None = None  # known once every parameter has optimizer state (after a step)
        self._saved = False
        self._layout: tuple = ()  # what the buffers were shaped for: (param index, key, shape, dtype)...
        self._buffers: list[torch.Tensor] = []  # parameters first, then each state tensor, as _sources
        self._state: dict[nn.Parameter, dict] = {}  # per parameter with state: key -> saved value

    def affordable(self) -> bool:
        """Whether to step ahead this step: enabled, and the state (parameters and optimizer state) small
        enough to copy every step. Called every step: the size is summed until the optimizer state is
        complete, then kept."""
        if not self.enabled:
            return False
        if self._bytes is not None:
            return self._bytes <= MAX_BYTES
        n = sum(p.numel() * p.element_size() for p in self.params)
        n += sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                 for v in s.values() if isinstance(v, torch.Tensor))
        if all(p in self.optimizer.state for p in self.params):
            self._bytes = n
        return n <= MAX_BYTES

    def save(self) -> None:
        # Read the state's tensors afresh each time: an optimizer may replace them instead of
        # updating them in place; the buffers are reused while the shapes stay the same.
        state = self.optimizer.state
        entries = [(i, k, v) for i, p in enumerate(self.params) if p in state for k, v in state[p].items()]
        tensors = [(i, k, v) for i, k, v in entries if isinstance(v, torch.Tensor)]
        sources = [p.detach() for p in self.params] + [v for _, _, v in tensors]
        layout = tuple((i, k, v.shape, v.dtype, v.device) for i, k, v in tensors)
        if layout != self._layout or not self._buffers:
            self._buffers = [torch.empty_like(t) for t in sources]
            self._layout = layout
        with torch.no_grad():
            torch._foreach_copy_(self._buffers, sources)
        saved = iter(self._buffers[len(self.params):])
        self._state = {}
        for i, k, v in entries:
            self._state.setdefault(self.params[i], {})[k] = (next(saved) if isinstance(v, torch.Tensor)
                                                             else copy.deepcopy(v))
        self._saved = True

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
        self._buffers, self._state = [], {}  # the state now holds them: fresh buffers next time
        self.drop()
