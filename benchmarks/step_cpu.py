"""Where a trainer's main thread spends its CPU in a failure-free step: the model's work against unbroken's.

What it measures: one real run through the CLI (R replica groups of G ranks, each group a torchrun job,
the defaults of benchmarks/hsdp_overhead.py: 2 x 2, GPT 2 x 64, 4 microbatches). Every worker carries
thread-time clocks (benchmarks/_stepclock.py, put in through a sitecustomize on PYTHONPATH) around the
model's own work (the outermost module call with FSDP2's hooks, `backward` with its reduce-scatter,
AdamW's `step` and `zero_grad`: what a plain FSDP2 loop does too) and around unbroken's step functions.
Totals are read after --warmup s and again --seconds later; the difference is divided by the steps the
trainers counted between (their `train_step` calls).

Prints, per function and averaged over the ranks, the main thread's CPU ms a step (inclusive: a function's
figure holds what it calls; the clocks' own cost, ~1-2 us a call, is in them), then last
`ratio step_protocol_main_thread V`: the main thread's CPU a step outside what a plain FSDP2 loop does
(`train_step` less forward, backward and optimizer, and less the data, `part`, the dropout seed, the loss
weight and FSDP2's gradient-sync switch: the `plain.*` clocks) over the model's work: unbroken's step
protocol on the critical path, by function, where benchmarks/hsdp_overhead.py's
`hsdp_overhead_main_thread_cpu` gives the same against a baseline as one figure.

What it leaves out: every other thread (sidecar, watches, heartbeat, gloo's) and process (coordinator,
torchrun agents). What it puts in that a baseline would not count: the clocks' own cost (~1-2 us a clocked
call, ~50 calls a step outside the model), and the cross-group all-reduce's issue and wait
(`EpochGroup.allreduce`), which FSDP2 HSDP does inside `backward`. So the ratio is an upper bound on the
protocol's main-thread share. With 4 processes on 2 cores a small Python operation costs several times
what it costs alone (cold caches after each switch: an event's write, 5 us alone, takes ~45 us here), so
the absolute figures are this host's.
Usage: python benchmarks/step_cpu.py [--warmup 25] [--seconds 30] [--replicas 2] [--group-size 2]
       [--microbatches 4] [--n-layer 2] [--n-embd 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.runtime.launcher.processes import kill_tree

HERE = Path(__file__).resolve().parent
MODEL = ("model.forward", "model.backward", "optimizer.step", "optimizer.zero_grad")


def totals(out: Path) -> dict[str, dict[str, list[float]]]:
    """rank file -> label -> [thread s, calls], as the workers last wrote them."""
    return {p.name: json.loads(p.read_text())["totals"] for p in sorted(out.glob("clock-*.json"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=float, default=25.0, help="s from start before the window (start-up out)")
    ap.add_argument("--seconds", type=float, default=30.0, help="the window, s")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="step_cpu_") as tmp:
        site = Path(tmp, "site")
        site.mkdir()
        clocks = Path(tmp, "clocks")
        clocks.mkdir()
        site.joinpath("sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport _stepclock\n_stepclock.install({str(clocks)!r})\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(args.replicas),
               f"--parallel.group_size={args.group_size}", "--steps", "1000000", "--microbatches",
               str(args.microbatches), f"--model.n_layer={args.n_layer}", f"--model.n_embd={args.n_embd}",
               "--launch.progress=false", "--parallel.device=cpu", "--run.quotas=equal",
               "--coord.heartbeat_timeout=3600", "--coord.progress_timeout=3600",
               "--coord.collective_timeout=3600", "--coord.run_timeout=86400", "--out", str(Path(tmp, "run"))]
        with open(Path(tmp, "run.log"), "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            with console.status(f"warming up {args.warmup:g} s, then measuring {args.seconds:g} s"):
                time.sleep(args.warmup)
                first = totals(clocks)
                time.sleep(args.seconds)
                last = totals(clocks)
        finally:
            kill_tree(proc)
        if proc.poll() not in (None, -9, -15) or len(first) != args.replicas * args.group_size:
            sys.exit(f"the run did not reach its steady state with every rank clocked ({len(first)} ranks): "
                     f"{Path(tmp, 'run.log').read_text()[-2000:]}")
        per_step: dict[str, list[float]] = {}  # label -> ms a step, one per rank
        for name, end in last.items():
            start = first.get(name, {})
            steps = end["Trainer.train_step"][1] - start.get("Trainer.train_step", [0, 0])[1]
            if steps <= 0:
                sys.exit(f"{name}: no step in the window")
            for label, (s, _) in end.items():
                per_step.setdefault(label, []).append((s - start.get(label, [0.0, 0])[0]) * 1e3 / steps)
    mean = {label: sum(v) / len(v) for label, v in per_step.items()}
    model = sum(mean.get(label, 0.0) for label in MODEL)
    plain = sum(ms for label, ms in mean.items() if label.startswith("plain."))
    protocol = mean["Trainer.train_step"] - model - plain
    console.print(f"main-thread CPU ms a step, mean of {len(last)} ranks: {args.replicas} groups x "
                  f"{args.group_size} ranks, GPT {args.n_layer} x {args.n_embd}, {args.microbatches} microbatches, "
                  f"a {args.seconds:g} s window. Inclusive: a function's figure holds what it calls; plain.*: "
                  f"what a plain FSDP2 loop does too")
    table = Table()
    table.add_column("function")
    table.add_column("ms a step", justify="right")
    for label, ms in sorted(mean.items(), key=lambda x: -x[1]):
        table.add_row(label, f"{ms:.3f}")
    console.print(table)
    console.print(f"model's work {model:.2f} ms a step (forward, backward, optimizer), the plain loop's "
                  f"other work {plain:.2f}, unbroken's step protocol {protocol:.2f} (the rest of train_step)")
    print(f"ratio step_protocol_main_thread {protocol / model:.4f}")


if __name__ == "__main__":
    main()
