"""The `unbroken` command: a thin layer over the Python API and the report functions.

Owns: the top-level parser, the registry of subcommands, and one-line errors with exit code 2 for bad
input. Does not own: any subcommand's arguments or behaviour (commands.py, sim/cli.py, eval/real_runs.py
each register theirs), training, simulating or reporting logic.
"""
from __future__ import annotations

import argparse
import os
import sys

from unbroken.config import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the same single `unbroken: error: ...` line as every other bad input
    (argparse would print the usage block first). Subcommand parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"unbroken: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    """Parse, then run the chosen subcommand. Each subcommand is a parser and a run, registered by the
    module that owns it (`add_parser` / `add_parsers`, which set the parser's `run(args, rest)`)."""
    # torch's C++ layer prints a store client's lost connection as a warning with a stack trace (a lost
    # coordinator, a run's end); the command reports what happened in one line of its own instead.
    # Before torch is imported: c10 reads it once.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from unbroken import commands, export
    from unbroken.eval import real_runs
    from unbroken.sim import cli as sim_cli

    ap = _Parser(prog="unbroken", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    commands.add_parsers(sub)
    export.add_parser(sub)
    sim_cli.add_parser(sub).set_defaults(run=lambda args, rest: sim_cli.run(args))
    real_runs.add_parser(sub).set_defaults(run=lambda args, rest: real_runs.run(args))
    args, rest = ap.parse_known_args(argv)
    try:
        if rest and not getattr(args, "overrides", False):  # only train, resume, config, coordinator take --a.b=value
            raise ConfigError(f"unrecognized argument {rest[0]!r}")
        return args.run(args, rest)
    except ConfigError as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
