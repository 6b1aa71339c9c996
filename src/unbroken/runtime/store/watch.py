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
  a generation starts, or the run ends): its loop sleeps a liveness round (coord.heartbeat_interval)
  unless woken, where it read an exit count every 20 ms before.
And one watch of keys that are not counters: `DecisionWatch`, the commit/retry decision of each (step,
epoch) a member waits for, pushed to it the moment the proposer compare-and-sets it.
Does not own: membership itself (coordinator/coordinator.py) or what a member does on a change (policy.recovery).

Why blocking waits rather than reading `epoch` every 10 ms: such reads cost 100
store round trips a second per member, each a wake-up of the member's thread and of the store's server
thread; with 4 members on 2 cores, per-thread CPU times from /proc put that near 3% of the machine,
all of it taken from the training. The wait costs nothing until the counter moves and wakes at once.
Its timeout is a day (a timed-out wait logs two C++ warnings), after which it waits again on a fresh
client (`reconnect`), so no stale waiter is left on the server.
"""
from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

from torch.distributed import DistStoreError, Store

from unbroken.runtime.store import keys
from unbroken.runtime.store.client import get_written

_WAIT = datetime.timedelta(days=1)
_ABSENT = "\x00"  # no decision's value: what a compare-and-set of a missing decision key returns


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
        self.cond = threading.Condition()  # notified on every change; other watches may share it
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (checked on every change) or `timeout_s`."""
        with self.cond:
            return self.cond.wait_for(ready, timeout_s)

    def _run(self) -> None:
        while True:
            try:
                self._store.wait([self._key(self.current + 1)], _WAIT)
                if self._stopped:
                    return
                value = self._read(self._store)  # the authority: changes may have come in a burst
            except DistStoreError:  # a day without a change: wait again
                if self._reconnect is not None:
                    self._store = self._reconnect()
                continue
            except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                return
            if value > self.current:
                with self.cond:
                    self.current = value
                    self.cond.notify_all()


class EpochWatch(CounterWatch):
    """The membership epoch; `get("epoch")` blocks until the coordinator wrote it."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, keys.epoch_begun, lambda s: int(get_written(s, keys.epoch())), reconnect, "epoch-watch")


class WeightsWatch(CounterWatch):
    """How many times the coordinator published quota weights (`publish_weights`): a member re-reads
    `weights` only when this moved, where it read them after every step before (a round trip a step)."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, keys.weights_changed, lambda s: s.add(keys.weights_version(), 0), reconnect, "weights-watch")


class DecisionWatch:
    """The decisions of the (step, epoch)s a member waits for, each pushed to it when it is written.

    Call `watch(step, epoch)` before waiting for that decision, then wait on `cond` (the epoch watch's,
    so one wait wakes on either a decision or a new epoch) until `outcome(step, epoch)` is not None.
    The thread (its own client) blocks in `store.wait` on one `decision/{s}/{e}` key at a time, in
    the order asked, then reads it: two round trips per decision, where reading the key every 0.2-2 ms
    cost a waiting member ~6 (each a wake-up of it and of the store's server on cores the trainers
    share) and up to 2 ms of latency on the step's critical path.
    Every key asked for is written in the end: the decision is compare-and-set by the member that saw
    every member done (commit) or, once the epoch moved, by the waiting member itself (retry, policy
    .recovery), and a member that stops waiting otherwise leaves the process (fenced, or an error).
    """

    def __init__(self, store: Store, cond: threading.Condition, reconnect: Callable[[], Store] | None = None):
        self._store, self._reconnect, self.cond = store, reconnect, cond
        self._asked: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._decided: dict[tuple[int, int], str] = {}  # (step, epoch) -> the decision's value
        self._watched: set[tuple[int, int]] = set()
        threading.Thread(target=self._run, name="decision-watch", daemon=True).start()

    def watch(self, step: int, epoch: int) -> None:
        """Ask for the decision of (step, epoch); idempotent. Forgets the decisions of older steps."""
        if (step, epoch) in self._watched:
            return
        with self.cond:
            for old in [k for k in self._decided if k[0] < step - 1]:
                del self._decided[old]
        self._watched = {k for k in self._watched if k[0] >= step - 1} | {(step, epoch)}
        self._asked.put((step, epoch))

    def outcome(self, step: int, epoch: int) -> str | None:
        """The decision's value ("commit:{r}:{plan}" or "retry:{r}", coordination.Decision) once the
        decision of (step, epoch) was seen here, else None."""
        return self._decided.get((step, epoch))

    def _run(self) -> None:
        while True:
            step, epoch = self._asked.get()
            key = keys.decision(step, epoch)
            while True:
                try:
                    self._store.wait([key], _WAIT)
                    # a compare-and-set that cannot match returns the key's value (one round trip, where
                    # `get` is two), or our "\x00" itself when the key is missing
                    value = self._store.compare_set(key, _ABSENT, _ABSENT).decode()
                    if value != _ABSENT:
                        break
                    # Woken with no decision: the TCPStore server (libuv, torch 2.13) wakes a key's
                    # waiters on a compare-and-set that finds the key missing, i.e. on every `read` of
                    # it (store.read): the launcher's `last_committed` reads decision/{s}/{e} of the
                    # step in flight when it judges a lost replica under restart-memory, while the
                    # survivors wait for exactly that key. A wake is a hint, not the key: wait again.
                except DistStoreError:  # a day without the decision: wait again on a fresh client
                    if self._reconnect is not None:
                        self._store = self._reconnect()
                except Exception:  # noqa: BLE001 - the store went away: the run is over for this process
                    return
            with self.cond:
                self._decided[(step, epoch)] = value
                self.cond.notify_all()


def stop(watches: list[CounterWatch], via: Store, timeout_s: float = 5.0) -> None:
    """End the watches' threads now, for a process that goes on without their store (a test whose store
    server closes next: a thread left waiting prints a C++ warning when its connection drops). Every
    watch of a counter on this store must be among them: their waits are woken by setting the counter's
    next key through `via` (another client of the store), which any other watch of it would then find
    set at once, again and again. `read` stays the counter's authority. Call once, at the end."""
    for w in watches:
        w._stopped = True
    for key in {w._key(w.current + 1) for w in watches}:
        via.set(key, "stop")
    for w in watches:
        w._thread.join(timeout_s)


def publish_weights(store: Store, weights: str) -> None:
    """Write the quota weights (JSON), then wake the members' weights watches."""
    store.set(keys.weights(), weights)
    store.set(keys.weights_changed(store.add(keys.weights_version(), 1)), "1")


class WakeWatch(CounterWatch):
    """The coordinator's wake-up calls (`wake`), on the unprefixed store: every generation's."""

    def __init__(self, store: Store, reconnect: Callable[[], Store] | None = None):
        super().__init__(store, keys.wake, lambda s: s.add(keys.wakes(), 0), reconnect, "wake-watch")


def wake(store: Store) -> None:
    """Wake the coordinator's loop now, after writing what it should see: a worker's exit, a new
    generation, shutdown. `store` is the unprefixed store. Two round trips."""
    store.set(keys.wake(store.add(keys.wakes(), 1)), "1")
