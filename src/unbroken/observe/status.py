"""`unbroken status ADDR|RUN_DIR`: one screen of what a job is doing, from its coordinator or its run directory.

Owns: finding the figures (the coordinator's `status/view` store key plus its members' heartbeats, or a
fold of RUN_DIR/events.jsonl) and drawing them with rich; `--watch` redraws. Does not own: the figures'
definitions (observe/view.py) or their publication (runtime/coordinator/metrics.py). Bad targets raise ConfigError.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from unbroken.config import ConfigError
from unbroken.events import read_events
from unbroken.observe.view import RunView


def load(target: str) -> dict[str, Any]:
    """The status dict of RUN_DIR (any run, live or finished), of the coordinator at HOST:PORT, or of the
    run whose state lives at etcd://...[/namespace]."""
    path = Path(target)
    if path.is_dir() or path.exists():
        return _from_dir(path)
    if target.startswith("etcd://"):  # a run whose state lives in etcd (--coord.store)
        return _from_store(target)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{target!r} is neither a run directory nor HOST:PORT of a coordinator")
    return _from_store(target)


def _from_dir(path: Path) -> dict[str, Any]:
    if not (path / "events.jsonl").is_file():
        raise ConfigError(f"{str(path)!r} is not a run directory (no events.jsonl)")
    view = RunView(history=False)
    view.feed(read_events(path))  # CorruptLog (a ConfigError) names the file and line that does not parse
    if view.t0 is None:
        raise ConfigError(f"{str(path)!r} is not a run directory (its events.jsonl has no run_start)")
    view.checkpoint_step = _checkpoint_step(path, view.run_id)
    status = view.status(None if view.ended else time.time())
    status["source"] = f"{path} (event log)"
    return status


def _from_store(address: str) -> dict[str, Any]:
    from torch.distributed import PrefixStore

    from unbroken.runtime.store import keys
    from unbroken.runtime.store.client import connect
    host, _, port = address.rpartition(":")
    try:  # a plain probe first: TCPStore's client would retry, and print C++ stack traces, for seconds
        if address.startswith("etcd://"):  # the run's state in etcd: its client fails over by itself
            from unbroken.runtime.store.client import preflight
            preflight(address, run_id=None, exists=True)
        else:
            socket.create_connection((host, int(port)), timeout=3.0).close()
        store = connect(address, timeout_s=5.0)
    except (RuntimeError, OSError, OverflowError, ValueError) as e:
        raise ConfigError(f"cannot reach a coordinator at {address!r} ({e.strerror or e if isinstance(e, OSError) else e})"
                          ) from None
    if not store.check([keys.status()]):
        raise ConfigError(f"{address!r} serves a store with no unbroken status (not a coordinator, or too early)")
    status = json.loads(store.get(keys.status()))
    # the members' own heartbeats, fresher than the event log: where each one is right now
    generation = int(store.get(keys.generation())) if store.check([keys.generation()]) else 0
    members = PrefixStore(keys.generation_prefix(generation), store)  # the generation's keys, as the workers write them
    beats = {}
    for r in status["replicas"]:
        key = keys.heartbeat(r)
        if members.check([key]):
            raw = members.get(key).decode()
            beats[r] = "fenced" if not raw.startswith("{") else _beat(json.loads(raw))
    status["heartbeats"] = beats
    status["source"] = f"coordinator {address} (run dir {status.get('run_dir')})"
    return status


def _beat(hb: dict[str, Any]) -> str:
    return f"step {hb.get('step')} {hb.get('phase')}" + (f" mb {hb['mb']}" if hb.get("phase") == "compute" else "")


def _checkpoint_step(path: Path, run_id: str) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
        ck = cfg.get("checkpoint", {})
        if not ck.get("every"):
            return None
        from unbroken.runtime.coordinator.metrics import latest_checkpoint_step
        return latest_checkpoint_step(ck.get("dir") or str(path / "checkpoints"), run_id)
    except (OSError, ValueError):
        return None


def render(s: dict[str, Any]) -> Group:
    """The screen: a headline, members and their health, recent faults and recoveries, persistence."""
    state = ("[green]finished ok" if s["ok"] else f"[red]failed: {s['failed']}") if s["finished"] else (
        f"[red]failing: {s['failed']}" if s["failed"] else "[bold cyan]running")
    tps = s.get("tokens_per_second")
    loss = "-" if s["loss"] is None else f"{s['loss']:.4f}"
    head = Text.from_markup(
        f"[bold]{s['run_id']}[/]  {state}[/]  step {s['step'] + 1}/{s['steps']} committed  loss {loss}  "
        f"tokens {s['tokens']:,}" + (f" ({tps:,.0f}/s)" if tps else "") +
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
    parts = [head, members]
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


def show(target: str, watch: float | None, console: Console | None = None) -> int:
    """Print the screen once, or with `watch` redraw every `watch` s until the run finishes or Ctrl-C."""
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
