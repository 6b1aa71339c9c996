"""A member's view of the membership epoch, read by a thread of its own and pushed to the step loop.

Owns: one daemon thread with its own store client that reads `epoch` every `every_s` (10 ms) and, when
it moves, wakes whoever waits in `wait_until`. The step loop asks "has the epoch moved?" many times a
step (before reducing, while a collective runs, while waiting for a decision); with the watch that is a
plain int read, and waits wake on the change instead of sleeping and polling the store themselves.
Does not own: membership itself (coordinator.py) or what a member does on a change (policy.recovery).

Why a read every 10 ms rather than a blocking `store.wait` on a per-epoch key: it needs no wait-timeout
handling (a timed-out wait logs two C++ warnings each time), its lag is bounded at 10 ms, which a
recovery can afford, and it costs ~100 store round trips a second per member (~0.1% of a core each side).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed import Store


class EpochWatch:
    """`current` is the newest epoch seen (a plain int read: no store round trip).

    Create once per process per generation; `get("epoch")` blocks until the coordinator wrote it.
    The thread is a daemon and runs until the process leaves (workers leave with os._exit).
    """

    def __init__(self, store: Store, every_s: float = 0.01):
        self._store = store  # a client of its own: store clients are not thread-safe
        self.current = int(store.get("epoch"))
        self._every = every_s
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="epoch-watch", daemon=True)
        self._thread.start()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (checked on every epoch change) or `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(ready, timeout_s)

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            try:
                epoch = int(self._store.get("epoch"))
            except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                return
            if epoch > self.current:
                with self._cond:
                    self.current = epoch
                    self._cond.notify_all()
