"""What a run's processes cost to start: the local launcher's forked processes against fresh interpreters.

The same small run twice per round, in ABBA order, through unbroken's own CLI (`unbroken train`):
`--launch.launcher=torchrun`, where the coordinator and every group's plain `torchrun` job are fresh
interpreters and so is each rank (at its start and at its group's restart), against the default
`--launch.launcher=fork`: the launcher forks its server, which forks the coordinator and each group's
torchrun agent (forkrun), whose ranks fork from it. Both train the same steps to the same digests (checked).
The run: R groups of G ranks, a few steps, and one rank SIGKILLed at step 2 under `--launch.restarts=1`, so
torchrun restarts that group once (its ranks start twice), as the suite's fault tests do.

Measured: the CPU seconds of the whole process tree (the CLI's `getrusage(RUSAGE_CHILDREN)` delta: every
process is reaped by its parent, so each one's time reaches the CLI's), and the wall seconds of each run.
Last line `ratio start_cpu V`: the fork launcher's CPU over the plain commands', the median over rounds.
What it leaves out: a cluster, where each host has its own cores and a rank's ~3 CPU-s of imports are
paid on its own host rather than on 2 shared cores (there the gain is the restarted ranks' seconds to
ready, not the host's CPU); the training's own CPU is in both sides alike.
Usage: python benchmarks/start_cpu.py [--rounds 3] [--replicas 3] [--group-size 2] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table


def one_run(out: Path, launcher: str, args: argparse.Namespace) -> tuple[float, float, str]:
    """(CPU-s of the run's process tree, wall s, final digest) of one `unbroken train`."""
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(args.replicas), "--steps",
           str(args.steps), "--microbatches", str(2 * args.replicas), "--exact", "--launch.progress=false",
           f"--parallel.group_size={args.group_size}", "--parallel.device=cpu", f"--launch.launcher={launcher}",
           "--launch.restarts=1", f"--faults=kill:replica=0,rank={args.group_size - 1},step=2,phase=compute",
           "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"start_cpu: the {launcher} run failed: {r.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, summary["final_param_digest"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    console = Console()
    runs: dict[str, list[tuple[float, float]]] = {"torchrun": [], "fork": []}
    digests = set()
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console, transient=True) as progress:
        task = progress.add_task("runs", total=2 * args.rounds)
        for n in range(args.rounds):
            for launcher in ("torchrun", "fork") if n % 2 == 0 else ("fork", "torchrun"):  # ABBA
                cpu, wall, digest = one_run(Path(tmp) / f"{launcher}{n}", launcher, args)
                runs[launcher].append((cpu, wall))
                digests.add(digest)
                progress.advance(task)
    if len(digests) != 1:
        raise SystemExit(f"start_cpu: the launchers' runs ended on different digests: {sorted(digests)}")
    table = Table(title=f"{args.replicas} groups x {args.group_size} ranks, {args.steps} steps, one rank killed "
                        f"and its group restarted by torchrun; {args.rounds} rounds")
    for col in ("launcher", "CPU-s (median)", "CPU-s (each)", "wall s (median)"):
        table.add_column(col)
    for launcher, values in runs.items():
        table.add_row(launcher, f"{statistics.median(c for c, _ in values):.1f}",
                      " ".join(f"{c:.1f}" for c, _ in values), f"{statistics.median(w for _, w in values):.1f}")
    console.print(table)
    ratios = [f[0] / t[0] for f, t in zip(runs["fork"], runs["torchrun"])]
    walls = [f[1] / t[1] for f, t in zip(runs["fork"], runs["torchrun"])]
    print(f"ratio start_wall {statistics.median(walls):.3f}")
    print(f"ratio start_cpu {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
