"""The `unbroken` command: a thin layer over the Python API and the report functions.

Owns: argument parsing, one-line errors with exit code 2 for bad input, and terminal output.
Does not own: training, simulating or reporting logic.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unbroken.config import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the same single `unbroken: error: ...` line as every other bad input
    (argparse would print the usage block first). Subcommand parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"unbroken: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="unbroken", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with fault tolerance; writes OUT/events.jsonl and summary.json",
                       epilog="Any config key can be set with --section.key=value, e.g. --model.n_layer=4.")
    t.add_argument("--config", help="TOML file with [run], [model], [data], [optim], [coord] tables")
    t.add_argument("--replicas", type=int)
    t.add_argument("--steps", type=int)
    t.add_argument("--microbatches", type=int)
    t.add_argument("--exact", action="store_true", default=None, help="bitwise the failure-free trajectory")
    t.add_argument("--faults", help="e.g. 'kill:replica=1,step=10,phase=allreduce; hang:replica=2,step=14,for=8'")
    t.add_argument("--seed", type=int)
    t.add_argument("--data", help="text file or uint16 .bin token file (default: Python's stdlib source)")
    t.add_argument("--out", help="run directory (default runs/latest)")
    c = sub.add_parser("compare", help="compare two runs step by step")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--rtol", type=float)
    d = sub.add_parser("demo", help="a failure-free run and one that loses half its replicas, side by side")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--steps", type=int, default=24)
    d.add_argument("--replicas", type=int, default=4)
    a = sub.add_parser("audit", help="check that every committed step reduced each microbatch exactly once")
    a.add_argument("run")
    k = sub.add_parser("coordinator", help="serve a run's coordinator for torchrun jobs (README: On a cluster)",
                       epilog="Any config key can be set with --section.key=value, e.g. --run.replicas=4.")
    k.add_argument("--config", help="TOML file with [run], [model], [data], [optim], [coord] tables")
    k.add_argument("--out", required=True, help="run directory (shared by the workers' hosts)")
    k.add_argument("--host", default="127.0.0.1", help="address to bind: the cluster's private interface")
    k.add_argument("--port", type=int, default=29400)
    w = sub.add_parser("worker", help="one rank of a replica group: run it under torchrun")
    w.add_argument("--coordinator", required=True, help="host:port that `unbroken coordinator` printed")
    w.add_argument("--group", type=int, required=True, help="this torchrun job's replica group (0 .. replicas-1)")
    st = sub.add_parser("status", help="one screen of a running job (HOST:PORT of its coordinator) or a run dir")
    st.add_argument("target", metavar="ADDR|RUN_DIR")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until the run ends")
    rp = sub.add_parser("report", help="a PNG of a whole run over wall-clock time, and its figures as tables")
    rp.add_argument("run", metavar="RUN_DIR")
    rp.add_argument("--compare", action="append", default=[], metavar="REF_DIR",
                    help="a reference run drawn beside it (repeatable)")
    rp.add_argument("--png", help="where to write the picture (default RUN_DIR/report.png)")
    _add_optional_commands(sub)
    args, rest = ap.parse_known_args(argv)
    try:
        if rest and args.command not in ("train", "coordinator"):
            raise ConfigError(f"unrecognized argument {rest[0]!r}")
        return _dispatch(args, rest)
    except ConfigError as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return 2


def _add_optional_commands(sub) -> None:
    """Commands that live in their own packages: the simulator and the detection evaluation."""
    from unbroken.eval import real_runs
    from unbroken.sim import cli as sim_cli
    sim_cli.add_parser(sub)
    real_runs.add_parser(sub)


def _dispatch(args: argparse.Namespace, rest: list[str]) -> int:
    from unbroken import commands

    match args.command:
        case "train":
            return commands.train(args, rest)
        case "compare":
            return commands.compare(args.a, args.b, args.rtol)
        case "demo":
            return commands.demo(Path(args.out), args.steps, args.replicas)
        case "audit":
            return commands.audit(args.run)
        case "coordinator":
            return commands.coordinator(args, rest)
        case "worker":
            from unbroken.runtime import worker
            worker.main(["--coordinator", args.coordinator, "--group", str(args.group)])
        case "status":
            from unbroken import status
            if args.watch is not None and args.watch <= 0:
                raise ConfigError(f"--watch {args.watch}: must be a positive number of seconds")
            return status.show(args.target, args.watch)
        case "report":
            return commands.report_run(args.run, args.compare, args.png)
        case "sim":
            from unbroken.sim import cli as sim_cli
            return sim_cli.run(args)
        case "detect-eval":
            from unbroken.eval import real_runs
            return real_runs.run(args)
    raise ConfigError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
