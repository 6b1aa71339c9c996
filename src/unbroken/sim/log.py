"""The simulator's event log: the records of `unbroken.events`, written deterministically, hashed as written.

Owns: the byte form of simulated records (compact JSON, keys in insertion order, times rounded to 1 us)
and the sha256 of everything written, so "same seed, same log" is one comparison. Does not own: deciding
what happens (strategies/) or reading logs back (`unbroken.events.read_events` reads these files).

"t" is the virtual clock in seconds since the run started. Besides the kinds of events.py (run_start, step,
fault, member_dead, epoch, recovery, verdict, regime, run_end) the simulator writes:
  steps     first, count, microbatches (per step), replicas, epoch, tokens, total_tokens, gpu_hours, t
            (a run of consecutive committed steps with the same batch, instead of one `step` record each;
            `t` is when the last of them committed; written at every aggregate tick and every change)
  rollback  to_step, from_step, tokens (undone), total_tokens, reason   (steps [to_step, from_step) undone)
  restart   seconds, reason, members          (every process relaunched; training resumes at t + seconds)
  slow      replica, factor, until             (a fail-slow episode begins; factor 1.0: it ended)
  quotas    step, weights ({replica: weight})  (the detector changed quota weights from this step on)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from unbroken.events import SCHEMA_VERSION


class SimLog:
    """Buffered JSON-lines writer. `path=None` keeps records in memory only (tests, benchmarks)."""

    def __init__(self, path: str | Path | None = None, keep: bool = False):
        self.path = Path(path) if path is not None else None
        self._f = open(self.path, "w", encoding="utf-8") if self.path is not None else None
        self._hash = hashlib.sha256()
        self.records: list[dict[str, Any]] | None = [] if keep or self._f is None else None
        self.count = 0

    def emit(self, event: str, t: float, **fields: Any) -> None:
        record = {"event": event, "t": round(t, 6), **fields}
        if event == "run_start":
            record["schema"] = SCHEMA_VERSION  # the same record schema as real runs (events.py)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        self._hash.update(line.encode())
        self.count += 1
        if self._f is not None:
            self._f.write(line)
        if self.records is not None:
            self.records.append(record)

    def digest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
