"""Reading runs back: summary, step-by-step comparison, and the exactly-once audit.

Owns: everything computed from `events.jsonl` after (or while) a run happens; reads real and simulated
logs alike. Does not own: writing events (events.py), running anything, or pictures (runplot.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.events import read_events, steps


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
    """Totals of a run: steps committed, tokens, faults, deaths, recoveries, wall time, final digest."""
    records = read_events(path)
    committed = steps(records)
    start = next((r["t"] for r in records if r["event"] == "run_start"), None)
    end = next((r for r in records if r["event"] == "run_end"), None)
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
        "recoveries": kinds.count("recovery"),
        "fenced": kinds.count("fenced"),
        "final_epoch": max((r["epoch"] for r in records if r["event"] == "epoch"), default=0),
        "ok": bool(end and end.get("ok")),
        "error": end.get("error") if end else None,
        "exact": cfg.run.exact if cfg is not None else None,
    }


@dataclass(frozen=True)
class Comparison:
    rows: list[tuple[int, float | None, float | None, bool, bool]]  # step, loss a, loss b, same digest, within rtol
    identical: int
    within: int
    total: int


def compare(a: str | Path, b: str | Path, rtol: float | None = None) -> Comparison:
    """Per-step comparison of run b against reference a (the reference's steps are the N)."""
    sa, sb = steps(read_events(a)), steps(read_events(b))
    rows = []
    for s in sorted(set(sa) | set(sb)):
        ra, rb = sa.get(s), sb.get(s)
        same = bool(ra and rb and ra["param_digest"] == rb["param_digest"])
        close = bool(ra and rb and abs(ra["loss"] - rb["loss"]) <= (rtol or 0.0) * abs(ra["loss"]))
        rows.append((s, ra and ra["loss"], rb and rb["loss"], same, close))
    total = max(len(sa), len(sb))
    return Comparison(rows, sum(r[3] for r in rows), sum(r[4] for r in rows), total)


def audit(path: str | Path, microbatches: int) -> list[str]:
    """Exactly-once audit: for every committed step, the microbatches reduced in its commit epoch, by
    owner, must be 0..M-1, each exactly once, and every member's applied digest must agree.
    Returns the problems found (empty: the log is clean)."""
    records = read_events(path)
    problems = []
    applied: dict[int, set[str]] = {}
    for r in records:
        if r["event"] == "applied":
            applied.setdefault(r["step"], set()).add(r.get("state_digest") or r["param_digest"])
    for s, r in sorted(steps(records).items()):
        owned = [mb for mbs in r["owners"].values() for mb in mbs]
        if sorted(owned) != list(range(microbatches)):
            dup = sorted({m for m in owned if owned.count(m) > 1})
            missing = sorted(set(range(microbatches)) - set(owned))
            problems.append(f"step {s}: duplicated {dup}, missing {missing}")
        if sorted(map(int, r["owners"])) != sorted(r["members"]):
            problems.append(f"step {s}: owners {sorted(r['owners'])} are not the commit members {r['members']}")
        if len(applied.get(s, ())) != 1:
            problems.append(f"step {s}: replicas applied {len(applied.get(s, ()))} different digests")
    return problems
