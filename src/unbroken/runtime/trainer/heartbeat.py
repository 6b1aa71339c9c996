"""A member's heartbeat thread: says where the replica is, and fences it once it was declared dead.

Owns: a background thread with its own store client (clients are not thread-safe) that writes
`hb/{r}` every interval with (seq, step, phase, microbatch, epoch), and that ends the process once it
was declared dead: a zombie (stopped, then continued after the coordinator gave up on it) learns it is
no longer a member within one interval of waking and leaves without writing anything into a later step.
A beat is one round trip: a compare-and-set from the value it wrote last, which fails once the
coordinator, after writing `dead/{r}`, overwrote `hb/{r}` with its fence mark (where a write and a
`dead/{r}` check were two: 80 of the store's ~800 requests a second in a 4-replica run).
A beat whose connection breaks (the coordinator's host gone, or this host's link down long enough for the
connection to reset) is retried once on a fresh connection; where none can be made within `give_up_s`
(the coordinator has declared this member dead by then), the process leaves as fenced, with its event,
instead of dying of the store client's exception. A beat that does not come back at all (the link down:
the connection neither answers nor fails for the minutes TCP retries) is watched by a second thread: with
no beat through for `cut_off_s`, the process leaves as fenced the same way (the coordinator's own host
partitioned away, or this one's: the coordinator declared it dead long before).
Does not own: judging liveness (coordinator) or the member's own fence checks in the step (trainer).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

from torch.distributed import PrefixStore

from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect


class FenceLatch:
    """A process leaves as fenced once: whichever of its heartbeat threads and its trainer sees the verdict
    first logs it and ends the process (the thread: exit 3 at once; the trainer: FencedOut up to the
    lifecycle's exit 3); the others find the latch taken and do nothing more. One per process incarnation,
    shared by its heartbeats and its trainer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._taken = False

    def claim(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            first, self._taken = not self._taken, True
            return first


class Heartbeat:
    def __init__(self, address: str, me: int, interval_s: float, on_fenced: Callable[[str], None],
                 prefix: str = "", rank: int = 0, spared: Callable[[str], bool] | None = None,
                 latch: FenceLatch | None = None, give_up_s: float = 10.0, cut_off_s: float = 60.0):
        self.me, self.interval, self.give_up, self.cut_off = me, interval_s, give_up_s, cut_off_s
        self._address, self._prefix = address, prefix
        self.latch = latch or FenceLatch()
        self.key = keys.heartbeat(me, rank)  # every rank of a group beats: any one silent kills the group
        self.where = {"step": -1, "phase": "start", "mb": -1, "epoch": 0}
        self._store = PrefixStore(prefix, connect(address)) if prefix else connect(address)
        self._on_fenced = on_fenced
        # spared(reason): a fence this process survives (it stops beating, and its trainer takes over):
        # a group declared dead for another rank's silence, whose survivor may go on shrunk
        self._spared = spared
        self._stop = threading.Event()
        self._kick = threading.Event()  # beat now (see `at`)
        self._seq = 0
        self._last = ""  # the value of our last beat ("": none yet, the key is missing)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._through = time.monotonic()  # when a beat last came back (the watchdog's clock)
        self._watchdog = threading.Thread(target=self._watch, name="heartbeat-watchdog", daemon=True)

    def start(self) -> None:
        if not self._beat() and not self._fence():
            return
        self._thread.start()
        self._watchdog.start()

    def at(self, step: int, phase: str, mb: int = -1, epoch: int | None = None) -> None:
        """Record where the replica is; cheap (a dict update), call at every phase and microbatch.

        Leaving "start" beats at once: the coordinator judges a member whose last beat says "start" by
        the start-up timeout (minutes), so one killed before its thread's next beat would stay a member
        that long (seen under torchrun, where no launcher reports the exit: 120 s of survivors waiting)."""
        leaving_start = self.where["phase"] == "start" and phase != "start"
        self.where = {"step": step, "phase": phase, "mb": mb,
                      "epoch": self.where["epoch"] if epoch is None else epoch}
        if leaving_start:
            self._kick.set()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()

    def _beat(self) -> bool:
        """Write the next beat; False if the coordinator's fence mark stands where our last beat was."""
        self._seq += 1
        value = json.dumps({"seq": self._seq, **self.where})
        if self._store.compare_set(self.key, self._last, value) != value.encode():
            return False
        self._last, self._through = value, time.monotonic()
        return True

    def _fence(self) -> bool:
        """Leave (exit 3), unless `spared`: then stop beating and return False."""
        reason = json.loads(self._store.get(keys.dead(self.me)))["reason"]
        if self._spared is not None and self._spared(reason):
            self._stop.set()
            return False
        if not self.latch.claim():  # the trainer is leaving as fenced already: it exits 3
            self._stop.set()
            return False
        self._on_fenced(f"declared dead ({reason})")
        os._exit(3)

    def _run(self) -> None:
        while True:
            self._kick.wait(self.interval)  # every interval, or at once when kicked
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                beat = self._beat()
            except Exception as e:  # noqa: BLE001 - the store's connection broke: reconnect or leave
                self._reconnect(e)
                continue
            if not beat and not self._fence():
                return

    def _watch(self) -> None:
        """Leave as fenced (exit 3) once no beat came back for `cut_off_s`; return once stopped."""
        while not self._stop.wait(min(1.0, self.cut_off / 4)):
            silent = time.monotonic() - self._through
            if silent > self.cut_off:
                self._leave(f"cut off from the coordinator at {self._address} (no beat through for {silent:.0f} s)")
                return

    def _leave(self, why: str) -> None:
        if self._stop.is_set() or not self.latch.claim():
            self._stop.set()
            return
        self._on_fenced(why)
        os._exit(3)

    def _reconnect(self, error: Exception) -> None:
        """A fresh connection to the store in place of a broken one; where none answers within
        `give_up_s`, leave as fenced (exit 3): by then the coordinator has declared this member dead."""
        try:
            raw = connect(self._address, timeout_s=self.give_up)
        except Exception:  # noqa: BLE001 - nothing answers: this member is cut off
            self._leave(f"cut off from the coordinator at {self._address} ({type(error).__name__}: {error})")
            return
        self._store = PrefixStore(self._prefix, raw) if self._prefix else raw


class Beats:
    """Heartbeats of several rank indices as one: a shrunk group's one rank beats for every rank index it
    stands in for (runtime/parallel/standin.py), since the coordinator judges each index of a member
    group. The same calls as `Heartbeat`."""

    def __init__(self, beats: list[Heartbeat]):
        self.beats = beats
        self.latch = beats[0].latch  # one per process: every beat is given the same (lifecycle.connection)

    def start(self) -> None:
        for b in self.beats:
            b.start()

    def at(self, step: int, phase: str, mb: int = -1, epoch: int | None = None) -> None:
        for b in self.beats:
            b.at(step, phase, mb, epoch)

    def stop(self) -> None:
        for b in self.beats:
            b.stop()
