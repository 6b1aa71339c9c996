"""What each `unbroken` subcommand does, given parsed arguments. Terminal output goes through rich.

Owns: train/compare/demo/audit as user-facing commands with their exit codes (0 ok, 1 run failed or runs
differ, 2 bad input). Does not own: parsing (cli.py) or any training logic.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken import report
from unbroken.api import make_config
from unbroken.config import ConfigError, load, parse_overrides
from unbroken.events import CorruptLog

console = Console()


def train(args: argparse.Namespace, rest: list[str]) -> int:
    overrides = parse_overrides(rest)
    for flag in ("replicas", "steps", "microbatches", "exact", "faults", "seed", "out"):
        value = getattr(args, flag)
        if value is not None:
            overrides[f"run.{flag}"] = value
    if args.data is not None:
        overrides["data.path"] = args.data
    cfg = make_config(load(args.config, overrides))
    from unbroken.runtime.launch import launch
    result = launch(cfg)
    s = result.summary
    console.print(f"run dir: {result.run_dir}  steps committed: {s['steps_committed']}/{cfg.run.steps}  "
                  f"final loss: {s['final_loss']}  replicas lost: {s['members_lost']}  seconds: {s['seconds']}")
    if not result.ok:
        print(f"unbroken: error: {result.error}", file=sys.stderr)
        return 1
    return 0


def compare(a: str, b: str, rtol: float | None) -> int:
    """Exit 0 only if both runs are complete and every step matches (digests, or losses within rtol)."""
    for d in (a, b):
        if not (Path(d) / "events.jsonl").is_file():
            raise ConfigError(f"{d!r} is not a run directory (no events.jsonl)")
    try:
        cmp = report.compare(a, b, rtol)
    except CorruptLog as e:
        raise ConfigError(str(e)) from None
    table = Table(title=f"{a}  vs  {b}")
    for col in ("step", "loss A", "loss B", "digest", f"rtol {rtol}" if rtol is not None else ""):
        table.add_column(col)
    for step, la, lb, same, close in cmp.rows:
        table.add_row(str(step), _f(la), _f(lb), "same" if same else "[red]differs", "ok" if close else "")
    console.print(table)
    for p in cmp.problems:
        print(f"incomplete: {p}")
    if rtol is not None:
        print(f"within rtol: {cmp.within}/{cmp.total} steps")
        return 0 if cmp.within == cmp.total and not cmp.problems else 1
    print(f"identical: {cmp.identical}/{cmp.total} steps" + (" (a run is incomplete)" if cmp.problems else ""))
    return 0 if cmp.identical == cmp.total and not cmp.problems else 1


def audit(run: str) -> int:
    """Exit 0 only if the run is complete and every microbatch of every step was reduced exactly once."""
    from unbroken.audit import audit_run, run_config
    if not (Path(run) / "events.jsonl").is_file():
        raise ConfigError(f"{run!r} is not a run directory (no events.jsonl)")
    try:
        config = run_config(run)
    except FileNotFoundError:
        raise ConfigError(f"{run!r} has no config.json: cannot tell what the run was meant to do") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        problems = audit_run(run, config)
    except CorruptLog as e:
        raise ConfigError(str(e)) from None
    for p in problems:
        print(p)
    print(f"audit: {len(problems)} problems")
    return 0 if not problems else 1


def demo(out: Path, steps: int, replicas: int) -> int:
    """A failure-free reference and a run that loses half its replicas, in --exact mode, side by side."""
    lost = list(range(1, replicas, 2))[: max(1, replicas // 2)]
    phases = ["allreduce", "compute", "commit", "optimizer"]
    faults = "; ".join(f"kill:replica={r},step={max(1, (n + 1) * steps // (len(lost) + 1))},phase={phases[n % 4]}"
                       for n, r in enumerate(lost))
    console.rule(f"[bold]unbroken demo: {replicas} replicas, {steps} steps, exact mode")
    console.print(f"faulty run injects: {faults}")
    from unbroken.runtime.launch import launch
    runs = {}
    for name, spec in (("reference", ""), ("faulty", faults)):
        cfg = make_config(None, replicas=replicas, steps=steps, microbatches=8, exact=True, faults=spec,
                          out=str(out / name))
        result = launch(cfg, title=name)
        if not result.ok:
            print(f"unbroken: error: {name} run failed: {result.error}", file=sys.stderr)
            return 1
        runs[name] = result
    cmp = report.compare(out / "reference", out / "faulty")
    table = Table(title="failure-free reference vs. a run that loses half its replicas")
    for col in ("step", "reference loss", "faulty loss", "replicas", "param digest"):
        table.add_column(col, justify="right")
    faulty_steps = report.steps(report.read_events(out / "faulty"))
    for step, la, lb, same, _ in cmp.rows:
        table.add_row(str(step), _f(la), _f(lb), str(faulty_steps[step]["replicas"]),
                      "[green]identical" if same else "[red]differs")
    console.print(table)
    png = report.plot_losses({"failure-free": out / "reference", "loses half its replicas": out / "faulty"},
                             out / "loss.png",
                             title=f"unbroken demo: {len(lost)} of {replicas} replicas killed (red lines)")
    for name, r in runs.items():
        s = r.summary
        console.print(f"{name}: {s['seconds']:.1f} s, {s['members_lost']} replicas lost, "
                      f"{s['recoveries']} in-step recoveries, final digest {s['final_param_digest'][:16]}")
    console.print(f"plot: {png}")
    print(f"identical: {cmp.identical}/{cmp.total} steps")
    return 0 if cmp.identical == cmp.total else 1


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"
