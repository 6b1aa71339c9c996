"""A member's view of the membership epoch, kept by a thread of its own and pushed to the step loop.

Owns: one daemon thread with its own store client that blocks in `store.wait` on the key the coordinator
sets when epoch `current + 1` begins (`epochs/{e}`, after `epoch` itself) and, when it moves, wakes
whoever waits in `wait_until`. The step loop asks "has the epoch moved?" many times a step (before
reducing, while a collective runs, while waiting for a decision); with the watch that is a plain int
read, and waits wake on the change instead of sleeping and polling the store themselves.
Does not own: membership itself (coordinator.py) or what a member does on a change (policy.recovery).

Why a blocking wait rather than reading `epoch` every 10 ms (an earlier version): the reads cost 100
store round trips a second per member, each a wake-up of the member's thread and of the store's server
thread; with 4 members on 2 cores, per-thread CPU times from /proc put that near 3% of the machine,
all of it taken from the training. The wait costs nothing until the epoch moves and wakes at once.
Its timeout is a day (a timed-out wait logs two C++ warnings), after which it waits again on a fresh
client (`reconnect`), so no stale waiter is left on the server.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

from torch.distributed import DistStoreError, Store

_WAIT = datetime.timedelta(days=1)


class EpochWatch:
    """`current` is the newest epoch seen (a plain int read: no store round trip).

    Create once per process per generation; `get("epoch")` blocks until the coordinator wrote it.
    The thread is a daemon and runs until the process leaves (workers leave with os._exit).
    """

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        self._store = store  # a client of its own: store clients are not thread-safe
        self._reconnect = reconnect  # after a timed-out wait: a fresh client, no stale waiter on the server
        self.current = int(store.get("epoch"))
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="epoch-watch", daemon=True)
        self._thread.start()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (checked on every epoch change) or `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(ready, timeout_s)

    def _run(self) -> None:
        while True:
            try:
                self._store.wait([epoch_key(self.current + 1)], _WAIT)
                epoch = int(self._store.get("epoch"))  # the authority: changes may have come in a burst
            except DistStoreError:  # a day without a change: wait again
                if self._reconnect is not None:
                    self._store = self._reconnect()
                continue
            except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                return
            if epoch > self.current:
                with self._cond:
                    self.current = epoch
                    self._cond.notify_all()


def epoch_key(epoch: int) -> str:
    """The key the coordinator sets once `epoch` has begun (after `members/{epoch}` and `epoch`)."""
    return f"epochs/{epoch}"
