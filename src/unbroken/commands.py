"""What each `unbroken` subcommand does, given parsed arguments. Terminal output goes through rich.

Owns: train/compare/demo/audit as user-facing commands with their exit codes (0 ok, 1 run failed or runs
differ, 2 bad input). Does not own: parsing (cli.py) or any training logic.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken import report, runplot, runreport
from unbroken.api import make_config
from unbroken.config import ConfigError, load, parse_overrides
from unbroken.status import wide_console

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
    from unbroken.runtime.launcher.launch import launch
    result = launch(cfg)
    s = result.summary
    console.print(f"run dir: {result.run_dir}  steps committed: {s['steps_committed']}/{cfg.run.steps}  "
                  f"final loss: {s['final_loss']}  replicas lost: {s['members_lost']}  seconds: {s['seconds']}")
    if not result.ok:
        print(f"unbroken: error: {result.error}", file=sys.stderr)
        return 1
    return 0


def coordinator(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken coordinator`: serve one run for torchrun jobs until it ends (runtime/control/standalone.py)."""
    overrides = parse_overrides(rest)
    overrides["run.out"] = args.out
    cfg = make_config(load(args.config, overrides))
    from unbroken.runtime.control import standalone
    code = standalone.run(cfg, args.host, args.port, say=lambda line: print(line, flush=True))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the store's watch thread blocks in a C++ wait: no interpreter shutdown under it


def compare(a: str, b: str, rtol: float | None) -> int:
    for d in (a, b):
        if not (Path(d) / "events.jsonl").is_file():
            raise ConfigError(f"{d!r} is not a run directory (no events.jsonl)")
    cmp = report.compare(a, b, rtol)
    table = Table(title=f"{a}  vs  {b}")
    for col in ("step", "loss A", "loss B", "digest", f"rtol {rtol}" if rtol is not None else ""):
        table.add_column(col)
    for step, la, lb, same, close in cmp.rows:
        table.add_row(str(step), _f(la), _f(lb), "same" if same else "[red]differs", "ok" if close else "")
    console.print(table)
    if rtol is not None:
        print(f"within rtol: {cmp.within}/{cmp.total} steps")
        return 0 if cmp.within == cmp.total else 1
    print(f"identical: {cmp.identical}/{cmp.total} steps")
    return 0 if cmp.identical == cmp.total else 1


def audit(run: str) -> int:
    if not (Path(run) / "events.jsonl").is_file():
        raise ConfigError(f"{run!r} is not a run directory (no events.jsonl)")
    from unbroken.config import Config
    cfg = Config.from_json((Path(run) / "config.json").read_text())
    problems = report.audit(run, cfg.run.microbatches)
    for p in problems:
        print(p)
    print(f"audit: {len(problems)} problems")
    return 0 if not problems else 1


def report_run(run: str, compare: list[str], png: str | None) -> int:
    """`unbroken report`: the picture of a finished run (beside its references) and the same figures as tables."""
    main = runreport.timeline(run)
    refs = [runreport.timeline(r, f"ref {Path(r).name}" if Path(r).name == main.name else None) for r in compare]
    target = Path(png) if png else Path(run) / "report.png"
    if not target.parent.is_dir():
        raise ConfigError(f"--png {png!r}: no such directory {str(target.parent)!r}")
    drawn = runplot.write_png(main, refs, target)
    wide = wide_console(140)  # the tables have ~12 columns: not squeezed to rich's 80 in a pipe
    wide.print(runreport.summary_table([main, *refs]))
    wide.print(runreport.recovery_table(main))
    wide.print(runreport.step_table(main, refs))
    wide.print("panels: " + ", ".join(f"{k} ({n})" for k, n in drawn.items()))
    wide.print(f"plot: {target}")
    return 0


def demo(out: Path, steps: int, replicas: int) -> int:
    """A failure-free reference and a run that loses half its replicas, in --exact mode, side by side."""
    lost = list(range(1, replicas, 2))[: max(1, replicas // 2)]
    phases = ["allreduce", "compute", "commit", "optimizer"]
    faults = "; ".join(f"kill:replica={r},step={max(1, (n + 1) * steps // (len(lost) + 1))},phase={phases[n % 4]}"
                       for n, r in enumerate(lost))
    console.rule(f"[bold]unbroken demo: {replicas} replicas, {steps} steps, exact mode")
    console.print(f"faulty run injects: {faults}")
    from unbroken.runtime.launcher.launch import launch
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
    png = out / "report.png"
    runplot.write_png(runreport.timeline(out / "faulty", "loses half its replicas"),
                      [runreport.timeline(out / "reference", "failure-free")], png,
                      title=f"unbroken demo: {len(lost)} of {replicas} replicas killed (red lines), exact mode")
    for name, r in runs.items():
        s = r.summary
        console.print(f"{name}: {s['seconds']:.1f} s, {s['members_lost']} replicas lost, "
                      f"{s['recoveries']} in-step recoveries, final digest {s['final_param_digest'][:16]}")
    console.print(f"plot: {png}")
    print(f"identical: {cmp.identical}/{cmp.total} steps")
    return 0 if cmp.identical == cmp.total else 1


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"
