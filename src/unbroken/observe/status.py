"""`unbroken status ADDR|RUN_DIR`: one screen of what a job is doing, drawn with rich; `--watch` redraws.

Owns: drawing a status dict. Does not own: reading it from a run directory or a live coordinator
(runtime/coordinator/status.py, passed in as `load`), the figures' definitions (observe/view.py) or their
publication (runtime/coordinator/metrics.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from unbroken.config import ConfigError


def render(s: dict[str, Any]) -> Group:
    """The screen: a headline, members and their health, recent faults and recoveries, persistence."""
    state = ("[green]finished ok" if s["ok"] else f"[red]failed: {s['failed']}") if s["finished"] else (
        f"[red]failing: {s['failed']}" if s["failed"] else "[bold cyan]running")
    tps = s.get("tokens_per_second")
    loss = "-" if s["loss"] is None else f"{s['loss']:.4f}"
    head = Text.from_markup(
        f"[bold]{s['run_id']}[/]  {state}[/]  step {s['step'] + 1}/{s['steps']} committed  loss {loss}  "
        + (f"validation {s['eval_loss']:.4f} (step {s['eval_step']})  " if s.get("eval_loss") is not None else "")
        + f"tokens {s['tokens']:,}" + (f" ({tps:,.0f}/s)" if tps else "") +
        f"  epoch {s['epoch']}  generation {s['generation']}  members {s['members']}")
    members = Table(title="replica groups", title_justify="left")
    beats = s.get("heartbeats")
    for col in ("replica", "member", "health", "speed", "share of last step") + (("heartbeat",) if beats else ()) + (
            "why not a member",):
        members.add_column(col)
    colors = {"healthy": "green", "suspect": "yellow", "slow": "magenta", "dead": "red"}
    for r, m in s["replicas"].items():
        share = "-" if m["share"] is None else f"{m['share']:.0%}"
        speed = "-" if m["speed"] is None else f"{m['speed']:.2f}"
        row = [r, "yes" if m["member"] else "no", f"[{colors.get(m['health'], 'white')}]{m['health']}", speed, share]
        members.add_row(*row, *((beats.get(r, "-"),) if beats else ()), m["dead"] or "")
    faults = Table(title="recent faults", title_justify="left")
    for col in ("at s", "kind", "replica", "step", "phase"):
        faults.add_column(col, justify="right")
    for f in s["faults"]:
        faults.add_row(_since(f["t"], s), f["kind"], str(f.get("replica", "-")), str(f.get("step", "-")),
                       str(f.get("phase") or "-"))
    recov = Table(title="recent recoveries", title_justify="left")
    for col in ("at s", "step", "cause", "epochs", "seconds lost", "microbatches redone"):
        recov.add_column(col, justify="right")
    for i in s["incidents"]:
        lost = "[yellow]in progress" if i["seconds"] is None else f"{i['seconds']:.3f}" + (
            " (then restarted)" if i.get("superseded") else "")
        recov.add_row(_since(i["start"], s), str(i["step"]), i["cause"], f"{i['from_epoch']}->{i['to_epoch']}", lost,
                      str(i["redone"]))
    snap = s["snapshot"]
    persist = Text(
        ("snapshot: none" if snap is None else f"snapshot: step {snap['step']}, {snap['age_s']:.1f} s old, "
         f"{snap['steps_behind']} steps behind") + f"; {s['snapshots_skipped']} skipped;  checkpoint: " +
        ("none" if s["checkpoint_step"] is None else f"step {s['checkpoint_step']}") +
        f";  retries: {_counts(s['retries'])};  restarts: {_counts(s['restarts'])};  steps redone: {s['steps_redone']}")
    suspects = s.get("suspects") or {}
    parts = [head, members]
    if suspects:  # devices found computing wrong values (docs/corruption.md)
        evicted = s.get("evicted") or {}
        parts.append(Text("suspect devices (replica[.rank]: times found wrong): " + ", ".join(
            f"{d}: {n}" + (f" (evicted at step {evicted[d]})" if d in evicted else "")
            for d, n in sorted(suspects.items()))))
    parts += [faults] if s["faults"] else [Text("no faults")]
    parts += [recov] if s["incidents"] else [Text("no recoveries")]
    if s.get("metrics_error"):
        parts.append(Text(s["metrics_error"], style="red"))
    return Group(*parts, persist, Text(f"from {s['source']}", style="dim"))


def _counts(by: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(by.items())) or "none"


def _since(t: float, s: dict[str, Any]) -> str:
    return f"{t - s['t0']:.1f}" if s.get("t0") else "-"


def wide_console(width: int = 130) -> Console:
    """A terminal's own width; `width` columns when writing to a pipe or file (rich would take 80 there and
    wrap every row of a 7-column table)."""
    console = Console()
    return console if console.is_terminal else Console(width=width)


def show(target: str, watch: float | None, load: Callable[[str], dict[str, Any]],
         console: Console | None = None) -> int:
    """Print the screen of `load(target)` (runtime/coordinator/status.py) once, or with `watch` redraw
    every `watch` s until the run finishes or Ctrl-C."""
    console = console or wide_console()
    status = load(target)
    if watch is None:
        console.print(render(status))
        return 0
    from rich.live import Live
    with Live(render(status), console=console, refresh_per_second=4) as live:
        try:
            while not status["finished"]:
                time.sleep(watch)
                try:
                    status = load(target)
                except ConfigError:
                    break  # the coordinator went away: the run ended
                live.update(render(status))
        except KeyboardInterrupt:
            pass
    return 0
