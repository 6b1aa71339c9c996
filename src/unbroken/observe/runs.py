"""Reading runs back: summary, step-by-step comparison, and the exactly-once audit.

Owns: everything computed from `events.jsonl` after (or while) a run happens; reads real and simulated
logs alike. Does not own: writing events (events.py), running anything, or pictures (observe/plot.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.audit import audit_run
from unbroken.config import ConfigError
from unbroken.events import CorruptLog, read_log, step_copies, steps


def finish_run(run_dir: Path, cfg: Any, log: Any, t0: float, error: str | None) -> tuple[bool, dict, str | None]:
    """End a run's log: the `run_end` record and summary.json. Call once, by the process that owns the run
    (the launcher, or a standalone coordinator), after every trainer is gone. Returns (ok, summary, error):
    ok when no error was seen and every step committed."""
    import json
    import time

    summary = summarize(run_dir / "events.jsonl", cfg)
    ok = error is None and summary["steps_committed"] == cfg.run.steps
    if error is None and not ok:
        error = f"only {summary['steps_committed']} of {cfg.run.steps} steps committed"
    log.emit("run_end", ok=ok, steps_committed=summary["steps_committed"], seconds=round(time.time() - t0, 3),
             error=error)
    summary = summarize(run_dir / "events.jsonl", cfg)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.close()
    return ok, summary, error


def summarize(path: str | Path, cfg: Any = None) -> dict[str, Any]:
    """Totals of a run: steps committed, tokens, faults, deaths, recoveries, wall time, final digest.
    Never fails on a corrupt line (the launcher writes it whatever happened): it counts them in
    `corrupt_lines`, and the audit fails the run for them."""
    log = read_log(path, strict=False)
    records = log.records
    committed = steps(records)
    start = next((r["t"] for r in records if r["event"] == "run_start"), None)
    end = next((r for r in reversed(records) if r["event"] == "run_end"), None)  # the last: after a resume
    last = max(committed) if committed else -1
    kinds = [r["event"] for r in records]
    seconds = (end["t"] if end else max((r["t"] for r in records), default=0)) - (start or 0)
    tokens = sum(r["tokens"] for r in committed.values())
    return {
        "steps_committed": len(committed),
        "last_committed_step": last,
        "tokens_committed": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
        "final_loss": committed[last]["loss"] if committed else None,
        "final_param_digest": committed[last]["param_digest"] if committed else None,
        "faults": kinds.count("fault"),
        "members_lost": kinds.count("member_dead"),
        "members_rejoined": kinds.count("join"),
        "recoveries": kinds.count("recovery"),
        "fenced": kinds.count("fenced"),
        "final_epoch": max((r["epoch"] for r in records if r["event"] == "epoch"), default=0),
        "ok": bool(end and end.get("ok")),
        "error": end.get("error") if end else None,
        "exact": cfg.run.exact if cfg is not None else None,
        "corrupt_lines": list(log.corrupt),
    }


@dataclass(frozen=True)
class Comparison:
    """rows: (step, loss a, loss b, same digest, within rtol), one per step 0..N-1, N the larger of the
    two runs' configured step counts (run_start's `steps`, not the highest step recorded: a run that
    recorded fewer steps counts them as missing); a step with several copies (redone after a whole-job
    restart) counts as the same only if every copy in both runs has the reference's first copy's digest.
    problems: why a run is not complete (compare proves nothing about a run that did not finish)."""
    rows: list[tuple[int, float | None, float | None, bool, bool]]
    identical: int
    within: int
    total: int
    problems: list[str] = field(default_factory=list)


def compare(a: str | Path, b: str | Path, rtol: float | None = None) -> Comparison:
    """Per-step comparison of run b against reference a. Both must be complete (run_end ok, every
    step 0..N-1 recorded, no torn line) and of the same length, or `problems` says why not.
    Raises ConfigError (one line) if a log holds no run (empty, or no run_start record), CorruptLog
    (one line, naming the file) if a line other than a torn last one does not parse, or if run_start
    lacks `steps` or a step record lacks step, loss or param_digest."""
    problems = []
    copies = []
    lengths = []
    for name, path in (("A", a), ("B", b)):
        log = read_log(path)
        start = run_start(log.records, path)
        _check_records(start, log.records, path)
        problems += [f"run {name}: {p}" for p in _completeness(start, log.records, log.torn)]
        copies.append(step_copies(log.records))
        lengths.append(start["steps"])
    if lengths[0] != lengths[1]:
        problems.append(f"run A was configured for {lengths[0]} steps, run B for {lengths[1]}")
    ca, cb = copies
    n = max(lengths)
    rows = []
    for s in range(n):
        ra, rb = ca.get(s, []), cb.get(s, [])
        same = bool(ra and rb and {r["param_digest"] for r in ra + rb} == {ra[0]["param_digest"]} != {None})
        ref = ra[0]["loss"] if ra else None
        close = bool(ra and rb and ref is not None and all(
            isinstance(r["loss"], (int, float)) and abs(r["loss"] - ref) <= (rtol or 0.0) * abs(ref)
            for r in ra + rb))
        rows.append((s, ref, rb[-1]["loss"] if rb else None, same, close))
    return Comparison(rows, sum(r[3] for r in rows), sum(r[4] for r in rows), n, problems)


def run_start(records: list[dict[str, Any]], run: str | Path) -> dict[str, Any]:
    """The run_start record of `run`'s log (`records`, read back). Raises ConfigError (one line) if there
    is none: an empty or truncated log holds no run, bad input rather than a run with problems."""
    start = next((r for r in records if r["event"] == "run_start"), None)
    if start is None:
        raise ConfigError(f"{str(run)!r} is not a run directory (its events.jsonl has no run_start)")
    return start


def _check_records(start: dict[str, Any], records: list[dict[str, Any]], run: str | Path) -> None:
    """Raise CorruptLog (one line: the log, the step, the fields) if run_start lacks an int `steps` or a
    step record lacks what compare reads: such a log is not one the product wrote."""
    log = Path(run) / "events.jsonl" if Path(run).is_dir() else Path(run)
    if not isinstance(start.get("steps"), int):
        raise CorruptLog(f"{log}: run_start has no step count (steps = {start.get('steps')!r})")
    for r in records:
        lacks = [f for f in ("step", "loss", "param_digest") if r["event"] == "step" and f not in r]
        if lacks:
            raise CorruptLog(f"{log}: the record of step {r.get('step')} lacks {', '.join(lacks)}")


def _completeness(start: dict[str, Any], records: list[dict[str, Any]], torn: str | None) -> list[str]:
    """Why a log (its run_start and records, checked by _check_records) is not a finished run's: a torn
    last line, no run_end ok, a step of 0..N-1 without a record, a record past step N-1."""
    problems = [] if torn is None else ["torn last line"]
    end = next((r for r in reversed(records) if r["event"] == "run_end"), None)  # the last: after a resume
    if end is None or not end.get("ok"):
        problems.append("the run did not finish" + (f": {end.get('error')}" if end else " (no run_end)"))
    n = start["steps"]
    recorded = {r["step"] for r in records if r["event"] == "step"}
    absent = [s for s in range(n) if s not in recorded]
    if absent:
        problems.append(f"{len(absent)} of {n} steps have no record (first: {absent[0]})")
    extra = sorted((s for s in recorded if not (isinstance(s, int) and 0 <= s < n)), key=str)
    if extra:
        problems.append(f"steps recorded outside 0..{n - 1}: {extra}")
    return problems


def audit(path: str | Path, microbatches: int | None = None) -> list[str]:
    """The audit of audit.py (completeness and exactly-once), without a config.json check: the
    problems found, empty if the log is clean."""
    return audit_run(path, None, microbatches)
