"""`unbroken report`: the figures of one finished run (and its references) over wall-clock time, as series
for the picture (observe/plot.py) and as tables for the terminal.

Owns: reading finished runs into `Timeline`s (refusing directories that are not runs, or runs that have not
ended), and the tables. Does not own: the figures' definitions (observe/view.py) or drawing (observe/plot.py).
Times are seconds since each run's own `run_start`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from unbroken.config import ConfigError
from unbroken.events import SCHEMA_VERSION, read_events
from unbroken.observe.view import Incident, RunView


@dataclass(frozen=True)
class Timeline:
    """One run's figures over its wall clock (s since run start)."""
    name: str
    view: RunView
    end: float  # s: run_end
    loss: list[tuple[float, int, float]]  # (t, step, loss) at each step's first commit
    tokens: list[tuple[float, int]]  # (t, committed tokens, each step once)
    live: list[tuple[float, int]]  # (t, live replica groups) at each epoch; last value held to `end`
    faults: list[tuple[float, str]]  # (t, "kill r1 @3 allreduce")
    incidents: list[Incident]  # start/end already relative
    shares: dict[int, list[tuple[float, float]]]  # replica -> (t, share of the step's microbatches)
    evals: tuple[tuple[float, int, float], ...] = ()  # (t of the step's first commit, step, validation loss)


def timeline(run: str | Path, name: str | None = None) -> Timeline:
    """Read a finished run directory. Raises ConfigError (one line) for anything else."""
    path = Path(run)
    if not (path / "events.jsonl").is_file():
        raise ConfigError(f"{str(run)!r} is not a run directory (no events.jsonl)")
    view = RunView()
    view.feed(read_events(path))  # CorruptLog (a ConfigError) names the file and line that does not parse
    if view.t0 is None:
        raise ConfigError(f"{str(run)!r} is not a run directory (its events.jsonl has no run_start)")
    if view.schema > SCHEMA_VERSION:
        raise ConfigError(f"{str(run)!r} was written with event schema {view.schema}; this unbroken reads up to "
                          f"{SCHEMA_VERSION}")
    if view.ended is None:
        raise ConfigError(f"{str(run)!r} has not finished (no run_end record); for a live run: unbroken status")
    t0 = view.t0
    firsts = sorted(view.committed.values(), key=lambda r: r["t"])
    shares: dict[int, list[tuple[float, float]]] = {r: [] for r in range(view.replicas)}
    for rec in firsts:
        for r in shares:
            shares[r].append((rec["t"] - t0, len(rec["owners"].get(str(r), ())) / rec["microbatches"]))
    faults = []
    for f in view.faults:
        who = f"r{f['replica']}" if f.get("replica") is not None else (
            f"node {f['node']}" if f.get("node") is not None else "all")
        faults.append((f["t"] - t0, f"{f['kind']} {who} @{f.get('step')}" + (f" {f['phase']}" if f.get("phase") else "")))
    incidents = [Incident(i.step, i.start - t0, i.cause, i.from_epoch, i.to_epoch, set(i.redo),
                          None if i.end is None else i.end - t0, i.superseded) for i in view.incidents]
    return Timeline(name or path.name, view, view.ended["t"] - t0,
                    [(r["t"] - t0, r["step"], r["loss"]) for r in firsts],
                    [(0.0, 0)] + [(t - t0, n) for t, n in view.tokens_curve],
                    [(t - t0, n) for t, n in view.live], faults, incidents, shares,
                    tuple((view.committed[s]["t"] - t0, s, loss) for s, loss in sorted(view.evals.items())
                          if s in view.committed))


def summary_table(runs: list[Timeline]) -> Table:
    t = Table(title="runs", title_justify="left")
    for col in ("run", "wall s", "steps", "tokens", "tokens/s", "faults", "recoveries", "s lost", "redone mb",
                "steps redone", "final loss", "ok"):
        t.add_column(col, justify="right")
    for r in runs:
        v = r.view
        lost = sum(i.seconds or 0.0 for i in r.incidents)
        final = f"{r.loss[-1][2]:.4f}" if r.loss else "-"
        t.add_row(r.name, f"{r.end:.1f}", str(len(v.committed)), f"{v.tokens:,}",
                  f"{v.tokens / r.end:,.0f}" if r.end > 0 else "-", str(len(r.faults)), str(len(r.incidents)),
                  f"{lost:.3f}", str(sum(len(i.redo) for i in r.incidents)), str(v.steps_redone), final,
                  "yes" if v.ended.get("ok") else f"[red]no: {v.ended.get('error')}")
    return t


def recovery_table(run: Timeline) -> Table:
    t = Table(title=f"{run.name}: faults and recoveries", title_justify="left")
    for col in ("at s", "what", "step", "cause", "epochs", "seconds lost", "microbatches redone"):
        t.add_column(col, justify="right")
    rows = [(at, "fault", label, "", "", "", "") for at, label in run.faults]
    rows += [(i.start, "recovery" + (" cut short by a restart" if i.superseded else ""), str(i.step), i.cause,
              f"{i.from_epoch}->{i.to_epoch}",
              "unfinished" if i.seconds is None else f"{i.seconds:.3f}", str(len(i.redo))) for i in run.incidents]
    for at, *rest in sorted(rows, key=lambda r: r[0]):
        t.add_row(f"{at:.2f}", *rest)
    return t


def step_table(run: Timeline, refs: list[Timeline], max_rows: int = 30) -> Table:
    """Per committed step (sampled to `max_rows`, keeping every step a recovery touched): time, loss (and
    each reference's loss at that step), tokens, live groups, each replica's share."""
    t = Table(title=f"{run.name}: steps", title_justify="left")
    for col in ["at s", "step", "loss", *[f"loss {r.name}" for r in refs], "tokens", "live groups",
                *[f"share r{r}" for r in run.shares]]:
        t.add_column(col, justify="right")
    ref_loss = [{s: loss for _, s, loss in r.loss} for r in refs]
    touched = {i.step for i in run.incidents}
    every = max(1, -(-len(run.loss) // max_rows))
    for n, (at, step, loss) in enumerate(run.loss):
        if n % every and step not in touched and n != len(run.loss) - 1:
            continue
        live = next((k for tt, k in reversed(run.live) if tt <= at), 0)
        tokens = next((k for tt, k in reversed(run.tokens) if tt <= at), 0)
        shares = [f"{dict(v).get(at, 0.0):.0%}" for v in run.shares.values()]
        t.add_row(f"{at:.2f}", str(step), f"{loss:.4f}", *[f"{m[step]:.4f}" if step in m else "-" for m in ref_loss],
                  f"{tokens:,}", str(live), *shares)
    return t
