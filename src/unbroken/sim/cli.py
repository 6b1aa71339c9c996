"""`unbroken sim SCENARIO.toml [MORE.toml ...] [--strategy NAME ...] [--seed K] --out DIR`: compare recovery strategies.

Owns: the sim subcommand's arguments, its progress display, and what it writes under DIR:
STRATEGY/events.jsonl per strategy, summary.json, tokens.png / throughput.png / lost.png; with several
scenarios (a family: one job at several sizes), each under DIR/NAME/ and, across them, family.md (one
table) and family.png (sim/family.py). Does not own:
the top-level CLI (unbroken/cli.py wires `add_parser` and `run` in). Bad input is one line on stderr and
exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from unbroken.events import read_events
from unbroken.sim import scenario as scenario_mod
from unbroken.sim.runner import simulate
from unbroken.sim.strategies import STRATEGIES
from unbroken.sim.summary import summarize, table


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sim` on the top-level parser's subparsers; `run(args)` executes it."""
    p = subparsers.add_parser("sim", help="simulate recovery strategies on a described cluster")
    p.add_argument("scenario", nargs="+", help="scenario TOML file(s) (see scenarios/); several: a family")
    p.add_argument("--strategy", action="append", default=None, metavar="NAME",
                   help=f"strategy to run, repeatable (default: all of {', '.join(STRATEGIES)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault trace (same seed, same log)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--log-steps", action="store_true", help="one `step` record per step (large for long runs)")
    p.add_argument("--aggregate-seconds", type=float, default=3600.0,
                   help="virtual seconds between aggregate `steps` records (default 3600)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute `unbroken sim`; returns the process exit code (0 ok, 2 bad input)."""
    try:
        scs = [scenario_mod.load(path) for path in args.scenario]
    except scenario_mod.ScenarioError as e:
        print(f"unbroken sim: {e}", file=sys.stderr)
        return 2
    names = args.strategy or list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        print(f"unbroken sim: unknown strategy {unknown[0]!r} (known: {', '.join(STRATEGIES)})", file=sys.stderr)
        return 2
    if args.aggregate_seconds <= 0:
        print("unbroken sim: --aggregate-seconds must be > 0", file=sys.stderr)
        return 2
    if len({sc.name for sc in scs}) < len(scs):
        print("unbroken sim: two scenarios share a name; each needs its own folder", file=sys.stderr)
        return 2
    out = Path(args.out)
    if len(scs) == 1:
        _one(scs[0], names, args, out)
        return 0
    from unbroken.sim import family
    table = []
    for sc in scs:
        ends = _one(sc, names, args, out / sc.name)
        table += family.rows(sc.name, sc.cluster.gpus, family.step_seconds(sc), sc.step_tokens, ends)
    text = family.markdown(table)
    (out / "family.md").write_text(text + "\n")
    Console().print(text)
    if not args.no_plots:
        family.plot(table, out / "family.png", " / ".join(sc.name for sc in scs))
    return 0


def _one(sc: scenario_mod.Scenario, names: list[str], args: argparse.Namespace, out: Path) -> dict[str, dict]:
    """Simulate `names` on `sc` under `out`; writes the logs, summary.json and the plots; returns each
    strategy's run_end record."""
    err = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(f"simulating {sc.name}", total=len(names))
        for name in names:
            progress.update(task, description=f"{sc.name}: {name}")
            results.append(simulate(sc, name, args.seed, out, log_steps=args.log_steps,
                                    aggregate_seconds=args.aggregate_seconds))
            progress.advance(task)
    summaries = [summarize(read_events(r.path)) for r in results]
    console = Console()
    console.print(table(summaries, f"{sc.name} (seed {args.seed}, {sc.workload.duration_hours:g} h, "
                                   f"{sc.cluster.gpus} GPUs)"))
    if sc.chosen:
        console.print(f"[dim]chosen (not from the source): {', '.join(sc.chosen)}[/dim]")
    doc = {"scenario": sc.name, "source": sc.source, "seed": args.seed, "chosen": list(sc.chosen),
           "strategies": {r.strategy: {**r.end, "log_sha256": r.digest} for r in results}}
    (out / "summary.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if not args.no_plots:
        from unbroken.sim.plots import write_plots  # matplotlib only when plotting
        write_plots(summaries, out, sc.name)
    return {r.strategy: r.end for r in results}


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m unbroken.sim.cli ...`) until the top-level CLI wires `sim` in."""
    parser = argparse.ArgumentParser(prog="unbroken")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
