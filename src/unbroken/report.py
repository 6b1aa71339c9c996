"""Reading runs back: summary, step-by-step comparison, and the exactly-once audit.

Owns: everything computed from `events.jsonl` after (or while) a run happens; reads real and simulated
logs alike. Does not own: writing events (events.py), running anything, or pictures (runplot.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.audit import audit_run
from unbroken.events import read_log, step_copies, steps


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
    """rows: (step, loss a, loss b, same digest, within rtol), one per step 0..N-1 of the longer run;
    a step with several copies (redone after a whole-job restart) counts as the same only if every
    copy in both runs has the reference's first copy's digest. problems: why a run is not complete
    (compare proves nothing about a run that did not finish)."""
    rows: list[tuple[int, float | None, float | None, bool, bool]]
    identical: int
    within: int
    total: int
    problems: list[str] = field(default_factory=list)


def compare(a: str | Path, b: str | Path, rtol: float | None = None) -> Comparison:
    """Per-step comparison of run b against reference a. Both must be complete (run_end ok, every
    step 0..N-1 recorded, no torn line) and of the same length, or `problems` says why not.
    Raises CorruptLog if a line of either log other than a torn last one does not parse."""
    problems = []
    copies = []
    for name, path in (("A", a), ("B", b)):
        log = read_log(path)
        problems += [f"run {name}: {p}" for p in _completeness(log.records, log.torn)]
        copies.append(step_copies(log.records))
    ca, cb = copies
    n = max([len(ca), len(cb), *(s + 1 for s in ca), *(s + 1 for s in cb)])
    rows = []
    for s in range(n):
        ra, rb = ca.get(s, []), cb.get(s, [])
        same = bool(ra and rb and {r.get("param_digest") for r in ra + rb} == {ra[0].get("param_digest")} != {None})
        ref = ra[0].get("loss") if ra else None
        close = bool(ra and rb and ref is not None and all(
            isinstance(r.get("loss"), (int, float)) and abs(r["loss"] - ref) <= (rtol or 0.0) * abs(ref)
            for r in ra + rb))
        rows.append((s, ref, rb[-1]["loss"] if rb else None, same, close))
    return Comparison(rows, sum(r[3] for r in rows), sum(r[4] for r in rows), n, problems)


def _completeness(records: list[dict[str, Any]], torn: str | None) -> list[str]:
    """Why a log is not a finished run's: no run_start, no run_end ok, a step without a record."""
    problems = [] if torn is None else ["torn last line"]
    start = next((r for r in records if r["event"] == "run_start"), None)
    if start is None:
        return problems + ["no run_start record (empty or truncated log)"]
    end = next((r for r in reversed(records) if r["event"] == "run_end"), None)  # the last: after a resume
    if end is None or not end.get("ok"):
        problems.append("the run did not finish" + (f": {end.get('error')}" if end else " (no run_end)"))
    bad = sorted({r.get("step") for r in records if r["event"] == "step"
                  and not all(k in r for k in ("step", "loss", "param_digest"))}, key=str)
    if bad:
        problems.append(f"step records lacking step, loss or param_digest: {bad}")
    recorded = {r.get("step") for r in records if r["event"] == "step"}
    absent = [s for s in range(start["steps"]) if s not in recorded]
    if absent:
        problems.append(f"{len(absent)} of {start['steps']} steps have no record (first: {absent[0]})")
    return problems


def audit(path: str | Path, microbatches: int | None = None) -> list[str]:
    """The audit of audit.py (completeness and exactly-once), without a config.json check: the
    problems found, empty if the log is clean."""
    return audit_run(path, None, microbatches)
