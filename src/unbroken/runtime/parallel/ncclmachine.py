"""The decisions of one fault-tolerant NCCL cross-group reduction, as a small state machine over a backend.

Owns: when a communicator counts as formed, when a reduction counts as done, and when the communicator
must be aborted (the epoch moved during formation or the reduction, the collective failed, the timeout
passed), with exactly one outcome per reduction. Does not own: the communicator (a `Backend`: the real
one wraps torch's ProcessGroupNCCL in nccl.py, the unit tests drive a fake), the threads, the clock, or
what the caller does after an abort (the step protocol retries in the next epoch).

    FORMING --formed--> READY --issue--> REDUCING --completed--> DONE --issue--> REDUCING ...
       |                                    |
       +-- moved / error / timeout --> ABORTED <-- moved / failed / timeout --+

ABORTED is terminal: the communicator is unusable once aborted (NCCL: "every rank must abort when any
fails; an aborted collective's result is undefined"), so the group's later reductions fail at once and
the epoch's next membership forms a new communicator on a fresh store prefix.

An abort racing a completion has one outcome by construction: each poll reads the backend's completion
first and decides to abort only when the work is still pending; once ABORTED, completion is never read
again, so a collective that finishes while the abort is under way is discarded (it wrote the caller's
copy, never the accumulator). A peer declared dead moves the membership epoch (the coordinator), which
the caller passes in as `moved`.

Pure: no torch, no threads, no clock of its own; `abort_with` runs the backend's abort (the real group
hands it to a watcher thread, never a thread inside an NCCL call; tests run it inline).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class Phase(str, Enum):
    FORMING = "forming"
    READY = "ready"
    REDUCING = "reducing"
    DONE = "done"
    ABORTED = "aborted"


class Backend(Protocol):
    """A communicator of one (epoch, shard index), formed off the caller's thread. Every method but
    `abort` returns at once; `abort` may block, and is never called from inside another of its calls."""

    def formed(self) -> bool: ...  # the communicator exists and collectives may be issued
    def formation_error(self) -> str | None: ...  # formation failed (one line), else None
    def issue(self, copy: Any) -> None: ...  # start the all-reduce of `copy`, asynchronously
    def completed(self) -> bool: ...  # the issued all-reduce finished (well or not)
    def error(self) -> str | None: ...  # after `completed`: why it failed (one line), or None
    def abort(self) -> None: ...  # abort the communicator (a half-formed one too)


@dataclass(frozen=True)
class Failure:
    """Why the machine aborted: `moved` (the caller raises EpochMoved) or not (CollectiveError)."""
    moved: bool
    reason: str


class ReductionMachine:
    """One communicator's life: construct when its formation starts (`now`: the caller's clock, seconds),
    then `formation` until READY or ABORTED, and per reduction `issue` then `poll` until DONE or ABORTED.
    Single-threaded: the caller's thread drives it."""

    def __init__(self, backend: Backend, timeout_s: float, now: float,
                 abort_with: Callable[[Callable[[], None]], None]):
        self.backend, self.timeout_s, self.abort_with = backend, timeout_s, abort_with
        self.phase = Phase.FORMING
        self.failure: Failure | None = None
        self.since = now  # formation's or the current reduction's start
        self.aborts = 0  # abort requests handed to abort_with: at most one

    def formation(self, moved: bool, now: float) -> Phase:
        """Call while FORMING: READY once formed; ABORTED (the half-formed communicator aborted) when it
        failed, the epoch moved, or the timeout passed first. Any other phase is returned as it is."""
        if self.phase is not Phase.FORMING:
            return self.phase
        error = self.backend.formation_error()
        if error is not None:
            return self._abort(False, f"did not form: {error}")
        if self.backend.formed():
            self.phase = Phase.READY
        elif moved:
            return self._abort(True, "the epoch ended while its communicator formed")
        elif now - self.since > self.timeout_s:
            return self._abort(False, f"did not form within {self.timeout_s:g} s")
        return self.phase

    def issue(self, copy: Any, now: float) -> None:
        """Start a reduction of `copy` (READY or DONE only; ValueError otherwise)."""
        if self.phase not in (Phase.READY, Phase.DONE):
            raise ValueError(f"issue in phase {self.phase.value}")
        self.backend.issue(copy)
        self.phase, self.since = Phase.REDUCING, now

    def poll(self, moved: bool, now: float) -> Phase:
        """Call while REDUCING: DONE when the reduction finished well; ABORTED when it failed (a peer
        lost), the epoch moved, or the timeout passed. Completion is read first (the docstring above)."""
        if self.phase is not Phase.REDUCING:
            return self.phase
        if self.backend.completed():
            error = self.backend.error()
            if error is None:
                self.phase = Phase.DONE
                return self.phase
            return self._abort(False, f"failed: {error}")
        if moved:
            return self._abort(True, "the epoch ended during the all-reduce")
        if now - self.since > self.timeout_s:
            return self._abort(False, f"timed out after {self.timeout_s:g} s")
        return self.phase

    def _abort(self, moved: bool, reason: str) -> Phase:
        self.phase, self.failure = Phase.ABORTED, Failure(moved, reason)
        if self.aborts == 0:
            self.aborts = 1
            self.abort_with(self.backend.abort)
        return self.phase
