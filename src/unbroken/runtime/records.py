"""A member's step bookkeeping that needs no place on the step's critical path, in a thread of its own.

Owns: after each committed step, claiming the step record (`first_to_apply`: one member writes it), and
for the claimant reading the commit epoch's owners, hashing the parameters (sha256, ~2 ms for 1M of them)
and writing the `step` record; refreshing the quota weights the next plan proposes. All of it runs on a
single background thread with its own store client (clients are not thread-safe), beside the next step's
compute, instead of holding every peer at the next all-reduce.
Does not own: the step's decision (coordination.py) or what the record means (events.py).

Why it matters: on a machine whose cores the replicas share, every store round trip on the critical
path waits for the coordinator's server thread to be scheduled (~0.5-1 ms under load), and the sha256
of one member delays all of them at the next all-reduce.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from unbroken.events import EventLog
from unbroken.runtime.coordination import Coordination


class StepRecords:
    """`submit` once per applied step; `wait` before the parameters change again and before leaving.

    `digest()` is called on the background thread and must only read the parameters; the caller
    guarantees they do not change until `wait` returns.
    """

    def __init__(self, coord: Coordination, log: EventLog, digest: Callable[[], str]):
        self.coord, self.log, self.digest = coord, log, digest
        self.weights: dict[int, float] = json.loads(coord.store.get("weights"))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-records")
        self._pending: Future | None = None

    def submit(self, step: int, epoch: int, members: tuple[int, ...], record: dict) -> None:
        """Queue the bookkeeping of committed `step`; `record` holds the step record's other fields."""
        self.wait()
        record = {**record, "t": time.time()}  # the commit's time, not the hash's
        self._pending = self._pool.submit(self._run, step, epoch, members, record)

    def wait(self) -> None:
        """Block until the last submitted step's bookkeeping is done; re-raises its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _run(self, step: int, epoch: int, members: tuple[int, ...], record: dict) -> None:
        if self.coord.first_to_apply(step):
            owners = self.coord.held(step, epoch, members)
            self.log.emit("step", **record, epoch=epoch, members=list(members), replicas=len(members),
                          owners={str(m): v for m, v in owners.items()}, param_digest=self.digest())
        self.weights = {int(k): v for k, v in json.loads(self.coord.store.get("weights")).items()}
