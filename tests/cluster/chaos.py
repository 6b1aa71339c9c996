"""The host and network faults of the `--faults` grammar (faultspec.NETWORK_KINDS), injected into a run on
hosts made of namespaces: `host`, `partition` and `cut` at the first commit of their step, `rate` before the
run starts. Each writes a `fault` record into the run's event log (who: "harness") as it fires, and a
`fault_end` one where it ends (a partition's link back, a cut healed), so tests assert from the log alone.
Does not own: the hosts (hosts.py) nor the run (cluster_run.py).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.cluster.cluster_run import events
from tests.cluster.hosts import Cluster
from unbroken.events import EventLog
from unbroken.faultspec import NETWORK_KINDS, Fault, parse


def network_faults(spec: str, replicas: int, steps: int) -> tuple[Fault, ...]:
    """The spec's faults, all of NETWORK_KINDS (raises FaultSpecError, or ValueError naming another kind)."""
    faults = parse(spec, replicas, steps)
    for f in faults:
        if f.kind not in NETWORK_KINDS:
            raise ValueError(f"{f.kind}: not a host or network fault (those go in --run.faults)")
    return faults


class Injector:
    """Injects `faults` into the run whose events are in `out`, on `cluster`; `start` before the groups
    start (rates), `stop` at the end (joins its thread; heals nothing: the cluster's close removes all)."""

    def __init__(self, cluster: Cluster, out: Path, faults: tuple[Fault, ...]):
        self.cluster, self.out, self.faults = cluster, out, faults
        self.pending = [f for f in faults if f.kind != "rate"]
        self.ends: list[tuple[float, Fault]] = []  # (monotonic time, fault) of the faults that end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="net-faults", daemon=True)
        self.log: EventLog | None = None

    def start(self) -> None:
        for f in self.faults:
            if f.kind == "rate":
                self.cluster.rate(f.host, f.mbit)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _emit(self, event: str, f: Fault, **extra) -> None:
        if self.log is None:
            self.log = EventLog(self.out / "events.jsonl", who="harness")
        self.log.emit(event, kind=f.kind, host=f.host, step=f.step, **({"peer": f.peer} if f.peer is not None else {}),
                      **extra)

    def _committed(self) -> int:
        """The last committed step the log shows (-1: none yet)."""
        return max((e["step"] for e in events(self.out) if e["event"] == "step"), default=-1)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for t, f in [e for e in self.ends if e[0] <= now]:
                self.ends.remove((t, f))
                if f.kind == "partition":
                    self.cluster.mend(f.host)
                else:
                    self.cluster.join(f.host, f.peer)
                self._emit("fault_end", f)
            if not self.pending:
                if not self.ends:
                    return
                continue
            committed = self._committed()
            for f in [f for f in self.pending if f.step <= committed]:
                self.pending.remove(f)
                if f.kind == "host":
                    self.cluster.lose(f.host)
                elif f.kind == "partition":
                    self.cluster.cut(f.host)
                else:
                    self.cluster.split(f.host, f.peer)
                self._emit("fault", f, **({"seconds": f.seconds} if f.seconds else {}))
                if f.seconds:
                    self.ends.append((time.monotonic() + f.seconds, f))
