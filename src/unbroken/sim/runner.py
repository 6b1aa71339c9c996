"""One simulated run: a scenario, a strategy, a seed -> an event log and its run_end record.

Owns: wiring a strategy to its fault trace and its log file (`OUT/STRATEGY/events.jsonl`). Does not own:
the CLI (cli.py), summaries (summary.py) or the strategies' behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.sim.cluster import draw_faults
from unbroken.sim.log import SimLog
from unbroken.sim.scenario import Scenario
from unbroken.sim.strategies import STRATEGIES


class UnknownStrategy(ValueError):
    pass


@dataclass(frozen=True)
class Result:
    strategy: str
    end: dict[str, Any]  # the run_end record
    digest: str  # sha256 of the log's bytes
    records: list[dict[str, Any]] | None  # kept in memory when asked (or when nothing is written)
    path: Path | None


def simulate(scenario: Scenario, strategy: str, seed: int = 0, out: str | Path | None = None, *,
             log_steps: bool = False, keep: bool = False, aggregate_seconds: float = 3600.0) -> Result:
    """Simulate `strategy` on `scenario` with the fault trace of `seed`.

    With `out`, writes OUT/STRATEGY/events.jsonl; without, keeps the records in memory. Raises
    UnknownStrategy for a name not in STRATEGIES.
    """
    if strategy not in STRATEGIES:
        raise UnknownStrategy(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    path = None
    if out is not None:
        path = Path(out) / strategy / "events.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
    log = SimLog(path, keep=keep)
    try:
        run = STRATEGIES[strategy](scenario, draw_faults(scenario, seed), log, log_steps=log_steps,
                                   aggregate_seconds=aggregate_seconds, seed=seed)
        end = run.simulate()
    finally:
        log.close()
    return Result(strategy, end, log.digest(), log.records, path)
