"""Fault injection inside a replica: real signals at exact protocol points, and slowness.

Owns: firing the faults of `faultspec` that target this replica. kill = SIGKILL of this process; hang =
SIGSTOP of this process, with a detached `sh` that sends SIGCONT after `for` seconds (so the zombie path
runs for real); slow = stretch each microbatch's compute by `factor`: how=spin burns (factor-1) x its
device time (CPU time on a CPU) in the computing thread, as a throttled device; how=throttle burns until
the span has spent `factor` x what the replica's unslowed spans of the same work spent (else `factor` x
its own time); how=sleep sleeps (factor-1) x its wall time plus `for` seconds, which only wall clocks
see. Does not own: detection — nothing here is visible to the coordinator or the detector except through
time and signals.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections import deque

from torch.distributed import Store

from unbroken.events import EventLog
from unbroken.faultspec import Fault
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.devicetime import Span


class Injector:
    """`store` (unprefixed: it outlives restarts) records which faults fired, so a trainer restarted
    into a step it already ran does not fire the same fault again."""

    def __init__(self, faults: tuple[Fault, ...], me: int, log: EventLog, store: Store | None = None,
                 rank: int = 0, host: bool = False, sleep_cap_s: float = float("inf")):
        self.me, self.log, self.store = me, log, store
        # the most one how=sleep span sleeps: F-1 times a span that a loaded host stretched could sleep
        # past the progress timeout and get a healthy replica declared stuck; the worker passes a
        # quarter of coord.progress_timeout
        self.sleep_cap_s = sleep_cap_s
        # host: a kill takes this rank's torchrun agent (our parent) with it, as its host's loss would. A
        # rank under an agent of its own (parallel.on_rank_loss=replan) needs it: an agent that sees its
        # worker die, with no restarts left, closes the group's rendezvous, and no replacement could join
        self.host = host
        self.index = {id(f): n for n, f in enumerate(faults)}
        ours = [f for f in faults if f.replica == me and f.rank == rank]  # this process: (group, rank)
        self.tag = {"rank": rank} if rank else {}
        self.pending = [f for f in ours if f.kind in ("kill", "hang", "tear")]
        self.slow = [f for f in ours if f.kind == "slow"]
        self.flips = tuple(f for f in ours if f.kind == "flip")  # bitflip.Flipper fires them
        # device seconds of this replica's last unslowed spans, per shape of work (tokens, sum of squared
        # sequence lengths): what a slowed span of the same shape is stretched against (kept only where a
        # how=throttle fault targets this process: on a GPU reading it synchronizes)
        self.unslowed: dict[tuple[int, int], deque[float]] = {}
        self.aims = any(f.how == "throttle" for f in self.slow)  # only throttle reads them

    def at(self, step: int, phase: str, **detail) -> None:
        """Call at each protocol point; fires (once) any kill or hang scheduled for (step, phase). `detail`
        goes into the `fault` event (where in the phase: the overlap's buckets issued so far)."""
        for f in [f for f in self.pending if f.step == step and (f.phase or "snapshot") == phase]:
            self.pending.remove(f)
            if self.store is not None and self.store.add(keys.fired(self.index[id(f)]), 1) != 1:
                continue  # fired in an earlier generation of this run
            host = self.host and f.kind == "kill"
            self.log.emit("fault", kind=f.kind, replica=self.me, step=step, phase=phase,
                          seconds=f.seconds or None, pid=os.getpid(), **self.tag, **({"host": True} if host else {}),
                          **detail)
            if host:
                os.kill(os.getppid(), signal.SIGKILL)
            if f.kind in ("kill", "tear"):  # tear: while the snapshot copy thread is writing
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                subprocess.Popen(["sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"],
                                 start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                os.kill(os.getpid(), signal.SIGSTOP)
                self.log.emit("woke", replica=self.me, step=step, phase=phase)

    def stretch(self, step: int, span: Span, tokens: int = 0, sumsq: int = 0) -> None:
        """After a microbatch's compute (`tokens` tokens whose sequence lengths' squares sum to `sumsq`;
        several microbatches for a pipeline schedule), still inside its timed `span`: make it F times as
        long as it would be unslowed. Call once per span.

        how=spin burns (F-1) x the span's device time so far, on the span's own clock (devicetime.py).
        how=throttle burns device time on that clock until the span has spent F x
        the replica's unslowed device time for work of the same shape (the median of its last 16 unslowed
        spans of these tokens and sumsq); where it has seen no such span (variable-length sequences
        rarely repeat a shape), F x the span's own time so far. More CPU time in the computing thread, as
        a core throttled by F would need, so the detector sees it, and under contention it also takes
        longer in wall time, as real slow work would. Why against the unslowed spans where it can: on a
        CPU the spin itself slows the next microbatch's kernels (its caches are refilled after each
        spin; measured here: a factor-2 episode took 2.26x and a factor-3 one 3.35-3.78x the unslowed
        compute under spin's own-time rule, an overshoot that grew with F), so the slowed compute is not
        the unslowed one, and F x it is not what a device F times slower takes. spin stays the rule the
        detector's tests and thresholds were measured with: throttle moved their verdicts in CI (a
        recovery two steps later, a healthy replica Suspect), not yet understood.
        how=sleep sleeps (F-1) x the span's wall time plus the fault's `for` seconds, at most
        `sleep_cap_s`: wall time only, which the detector does not read (it emulates a host-side stall,
        e.g. a slow data loader, not a slow device). `for` is a stall of fixed length, for tests whose
        steps must last as long on a fast host as on a slow one: a grow back's fixed waits (keep-alive
        lapses, agent restarts) do not shrink with compute, and a factor's sleep does."""
        if not self.slow:
            return
        slowing = [f for f in self.slow if f.slows(self.me, step)]
        if not slowing:
            if tokens > 0 and self.aims:
                self.unslowed.setdefault((tokens, sumsq), deque(maxlen=16)).append(span.so_far())
            return
        worst = max(slowing, key=lambda f: (f.factor, f.seconds))
        if worst.how == "throttle":
            seen = self.unslowed.get((tokens, sumsq))
            unslowed = statistics.median(seen) if seen else span.so_far()
            span.burn(worst.factor * unslowed - span.so_far())
        elif worst.how == "spin":
            span.burn(span.so_far() * (worst.factor - 1.0))
        else:
            wall = time.perf_counter() - span.wall0
            time.sleep(min(self.sleep_cap_s, max(0.0, wall * (worst.factor - 1.0) + worst.seconds)))
