"""Counters published as numbered keys, each watched by a thread of its own that pushes changes to readers.

Owns: the watch thread (its own store client) that blocks in `store.wait` on the key set when the
counter reaches `current + 1` and, when it moves, wakes whoever waits in `wait_until`; three counters:
- the membership epoch (`epochs/{e}`, set by the coordinator after `epoch` itself). The step loop asks
  "has the epoch moved?" many times a step (before reducing, while a collective runs, while waiting for
  a decision); with the watch that is a plain int read, and waits wake on the change instead of
  sleeping and polling the store themselves.
- the quota weights' version (`weights/{n}`, set by the coordinator after `weights`): members re-read
  the weights when the detector changed them, not after every step.
- the coordinator's wake-up calls (`wake/{n}`, set by the launcher through `wake` after a worker exits,
  a generation starts, or the run ends): its loop sleeps a liveness round (100 ms) unless woken, where
  it read an exit count every 20 ms before.
Does not own: membership itself (coordinator.py) or what a member does on a change (policy.recovery).

Why blocking waits rather than reading `epoch` every 10 ms (an earlier version): the reads cost 100
store round trips a second per member, each a wake-up of the member's thread and of the store's server
thread; with 4 members on 2 cores, per-thread CPU times from /proc put that near 3% of the machine,
all of it taken from the training. The wait costs nothing until the counter moves and wakes at once.
Its timeout is a day (a timed-out wait logs two C++ warnings), after which it waits again on a fresh
client (`reconnect`), so no stale waiter is left on the server.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

from torch.distributed import DistStoreError, Store

_WAIT = datetime.timedelta(days=1)


class CounterWatch:
    """`current` is the newest value seen of a counter published as numbered keys (a plain int read: no
    store round trip); `key(n)` is set once the counter reached n, and `read(store)` reads the counter.

    Create once per process (per generation, for the epoch); the thread is a daemon and runs until the
    process leaves, which must be with os._exit: the thread blocks in a C++ store wait.
    """

    def __init__(self, store: Store, key: Callable[[int], str], read: Callable[[Store], int],
                 reconnect: Callable[[], Store] | None = None, name: str = "watch"):
        self._store = store  # a client of its own: store clients are not thread-safe
        self._reconnect = reconnect  # after a timed-out wait: a fresh client, no stale waiter on the server
        self._key, self._read = key, read
        self.current = read(store)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (checked on every change) or `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(ready, timeout_s)

    def _run(self) -> None:
        while True:
            try:
                self._store.wait([self._key(self.current + 1)], _WAIT)
                value = self._read(self._store)  # the authority: changes may have come in a burst
            except DistStoreError:  # a day without a change: wait again
                if self._reconnect is not None:
                    self._store = self._reconnect()
                continue
            except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                return
            if value > self.current:
                with self._cond:
                    self.current = value
                    self._cond.notify_all()


class EpochWatch(CounterWatch):
    """The membership epoch; `get("epoch")` blocks until the coordinator wrote it."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, epoch_key, lambda s: int(s.get("epoch")), reconnect, "epoch-watch")


class WeightsWatch(CounterWatch):
    """How many times the coordinator published quota weights (`publish_weights`): a member re-reads
    `weights` only when this moved, where it read them after every step before (a round trip a step)."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, _weights_key, lambda s: s.add("nweights", 0), reconnect, "weights-watch")


def publish_weights(store: Store, weights: str) -> None:
    """Write the quota weights (JSON), then wake the members' weights watches."""
    store.set("weights", weights)
    store.set(_weights_key(store.add("nweights", 1)), "1")


def _weights_key(n: int) -> str:
    return f"weights/{n}"


class WakeWatch(CounterWatch):
    """The coordinator's wake-up calls (`wake`), on the unprefixed store: every generation's."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, _wake_key, lambda s: s.add("wakes", 0), reconnect, "wake-watch")


def wake(store: Store) -> None:
    """Wake the coordinator's loop now, after writing what it should see: a worker's exit, a new
    generation, shutdown. `store` is the unprefixed store. Two round trips."""
    store.set(_wake_key(store.add("wakes", 1)), "1")


def _wake_key(n: int) -> str:
    return f"wake/{n}"


def epoch_key(epoch: int) -> str:
    """The key the coordinator sets once `epoch` has begun (after `members/{epoch}` and `epoch`)."""
    return f"epochs/{epoch}"
