"""A member's view of the membership epoch, pushed by the store instead of polled.

Owns: one daemon thread with its own store client that blocks in `store.wait` on the coordinator's
`epoch/{e+1}` key (written after `members/{e+1}`, `dead/...` and `epoch`), so a member learns of a new
epoch within one store round trip of its publication while costing nothing when nothing changes.
Does not own: membership itself (coordinator.py) or what a member does on a change (policy.recovery).

Why: the step loop asks "has the epoch moved?" many times a step (before reducing, every few ms while
a collective runs, while waiting for a decision). As store reads that was ~10% of a replica's wall time
and, on a machine whose cores the replicas share, CPU the coordinator's server thread took from compute.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

from torch.distributed import DistStoreError, Store


class EpochWatch:
    """`current` is the newest epoch seen (a plain int read: no store round trip).

    Create once per process per generation, after the coordinator has written `epoch`; `stop()` is
    optional (the thread is a daemon, and workers leave with os._exit).
    """

    def __init__(self, store: Store, wait_s: float = 30.0):
        self._store = store  # a client of its own: store clients are not thread-safe
        self.current = int(store.get("epoch"))
        self._wait = datetime.timedelta(seconds=wait_s)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="epoch-watch", daemon=True)
        self._thread.start()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (checked on every epoch change and every `poke`) or `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(ready, timeout_s)

    def poke(self) -> None:
        """Wake `wait_until` callers to re-check their condition (any thread may call it)."""
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # A timed-out wait is a quiet epoch; the client cancels it and stays usable.
                self._store.wait([f"epoch/{self.current + 1}"], self._wait)
            except DistStoreError as e:
                if "timeout" in str(e):
                    continue
                return
            except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                return
            with self._cond:
                self.current += 1
                self._cond.notify_all()
