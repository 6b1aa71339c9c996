"""Summaries of a run's log, simulated or real: committed tokens, throughput over time, losses by cause.

Owns: turning records (the kinds of `unbroken.events`, plus the simulator's `steps` and `rollback`) into a
frozen Summary and a rich table. Does not own: plots (plots.py) or producing logs.
A real run's log has no ledger: its lost GPU-hours by cause are empty and its GPU count is its replicas.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table


@dataclass(frozen=True)
class Summary:
    strategy: str
    seconds: float  # wall (virtual) time of the run, s
    steps: int
    tokens: int
    gpus: int
    steps_batch_differs: int
    lost_gpu_hours: dict[str, float] = field(default_factory=dict)
    curve: tuple[tuple[float, int, float], ...] = ()  # (t s, committed tokens so far, GPU-hours in service)
    faults: int = 0
    false_alarms: int | None = None  # the fail-slow detector's, where a strategy runs one

    @property
    def tokens_per_gpu_hour(self) -> float:
        return self.tokens / (self.gpus * self.seconds / 3600) if self.seconds > 0 else 0.0

    def tokens_at(self, gpu_hours: float) -> float:
        """Committed tokens when the in-service GPU-hours reached `gpu_hours` (linear between records)."""
        prev = (0.0, 0, 0.0)
        for point in self.curve:
            if point[2] >= gpu_hours:
                span = point[2] - prev[2]
                f = (gpu_hours - prev[2]) / span if span > 0 else 1.0
                return prev[1] + f * (point[1] - prev[1])
            prev = point
        return float(prev[1])

    def tokens_between(self, t0: float, t1: float) -> float:
        """Tokens committed in [t0, t1] s (linear between records)."""
        return self._at(t1) - self._at(t0)

    def _at(self, t: float) -> float:
        prev = (0.0, 0, 0.0)
        for point in self.curve:
            if point[0] >= t:
                span = point[0] - prev[0]
                return prev[1] + ((t - prev[0]) / span if span > 0 else 1.0) * (point[1] - prev[1])
            prev = point
        return float(prev[1])


def summarize(records: list[dict[str, Any]]) -> Summary:
    """A Summary of one run's records (a simulated strategy's or a real run's)."""
    start = next((r for r in records if r["event"] == "run_start"), {})
    end = next((r for r in records if r["event"] == "run_end"), {})
    t0 = 0.0 if "strategy" in start else float(start.get("t", records[0]["t"] if records else 0.0))
    gpus = int(start.get("gpus", start.get("replicas", 1)))
    curve: list[tuple[float, int, float]] = []
    tokens = steps = differ = 0
    m = start.get("microbatches")
    for r in records:
        kind = r["event"]
        if kind in ("step", "steps"):
            n = r.get("count", 1)
            tokens += r.get("tokens", 0)
            steps += n
            differ += n if m is not None and r.get("microbatches", m) != m else 0
        elif kind == "rollback":
            tokens = r["total_tokens"]
            steps = r["to_step"]
        else:
            continue
        hours = r.get("gpu_hours", gpus * (r["t"] - t0) / 3600)
        curve.append((r["t"] - t0, tokens, hours))
    seconds = float(end.get("seconds", curve[-1][0] if curve else 0.0))
    return Summary(start.get("strategy", "real"), seconds, steps, tokens, gpus,
                   end.get("steps_batch_differs", differ), dict(end.get("lost_gpu_hours", {})), tuple(curve),
                   sum(1 for r in records if r["event"] == "fault"), end.get("false_alarms"))


def table(summaries: list[Summary], title: str) -> Table:
    """A rich table comparing strategies; the first row is the reference for the ratio column."""
    t = Table(title=title)
    for col in ("strategy", "tokens", "tokens/GPU-h", "vs first", "steps", "batch differs", "faults",
                "GPU-h lost", "top loss"):
        t.add_column(col, justify="left" if col in ("strategy", "top loss") else "right")
    ref = summaries[0].tokens if summaries else 0
    for s in summaries:
        lost = sum(s.lost_gpu_hours.values())
        top = max(s.lost_gpu_hours.items(), key=lambda kv: kv[1], default=("-", 0.0))
        t.add_row(s.strategy, f"{s.tokens:.4g}", f"{s.tokens_per_gpu_hour:.4g}",
                  f"{s.tokens / ref:.3f}x" if ref else "-", str(s.steps), str(s.steps_batch_differs),
                  str(s.faults), f"{lost:.4g}", f"{top[0]} {top[1]:.3g}")
    return t
