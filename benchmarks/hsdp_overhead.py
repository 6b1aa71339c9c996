"""Failure-free overhead with replica groups: unbroken's HSDP step time against plain FSDP2 HSDP.

Both sides do the same work (benchmarks/_hsdp_baseline.py): R replica groups of G ranks, the same model
(the GPT, or the Llama with --model llama) sharded with FSDP2 over each group's ranks, the same M microbatches a step (M/R a group, each rank its
share of every microbatch's sequences), a SUM reduction with token loss weights, AdamW, one torch thread a
process. unbroken runs through its own CLI and launcher: a coordinator, one real torchrun job per group,
heartbeats and the store protocol on every rank, one reduce-scatter per step inside the group (on the
last microbatch, as the baseline) and a fault-tolerant all-reduce of each shard across groups per step,
digests and events. The baseline is one torch job on a (replicate, shard)
mesh with gradient sync only on a replica's last microbatch: what a torchtitan user runs without fault
tolerance.

How: the time-sliced method of benchmarks/overhead.py (its docstring says why): both runs live at once and
take turns, each frozen with SIGSTOP (with every descendant: torchrun agents, coordinator) while the other
runs a --window; a round's ratio is unbroken's median step interval over the baseline's, in ABBA order;
the figure is the median of the rounds' ratios with a 95% bootstrap interval, and the pooled ratio.

What the ratio leaves out: start-up (torchrun agents, imports, the first `fully_shard`), failures and
recovery. On the 2-core development machine 2 x 2 ranks are 4 trainer processes on 2 cores, so every
millisecond of unbroken's control plane (coordinator, torchrun agents, heartbeat and sidecar threads) is
taken from the training: the figure is then the control plane's CPU share plus what the trainers
themselves add, an upper bound on what a GPU node (a device a rank, host cores to spare) would see. So
the CPU each side spends a step is measured too (/proc, per thread, over the same windows) and split:
the trainers' main threads, gloo's threads in them (socket I/O: the same bytes a step on both sides),
their other threads (unbroken's heartbeat, sidecar, watches), and the control plane (coordinator,
launcher, torchrun agents), with `ratio hsdp_overhead_main_thread_cpu` (the trainers' main threads: the
step's critical path where helper threads and the control plane have cores of their own, as on a GPU
node), `..._trainer_cpu` (the trainer processes, every thread) and `..._total_cpu` (everything) printed
before the headline. On 2 saturated cores the wall-clock ratio follows the total CPU ratio.

With --exact both sides reduce in float64: unbroken's exact mode, and the baseline's FSDP2 with
`MixedPrecisionPolicy(reduce_dtype=torch.float64)` (the same reduce-scatter and all-reduce bytes), so the
ratio is what unbroken adds, not what float64 costs.

Prints a table, each side's peak resident memory per rank (VmHWM of the rank processes, read before they
stop) with `ratio hsdp_peak_memory` (unbroken's median rank over the baseline's; target <= 1.10), then last
`ratio hsdp_overhead <unbroken / FSDP2 HSDP>` (target <= 1.05).
Usage: python benchmarks/hsdp_overhead.py [--rounds 8] [--window 4] [--settle 2] [--replicas 2]
       [--group-size 2] [--microbatches 4] [--n-layer 2] [--n-embd 64] [--exact]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # overhead.py and the baseline, from anywhere
import _hsdp_baseline  # noqa: E402
from overhead import LONG, Side, bootstrap_ci, cpu_per_step, cpu_table, peak_mib, start_baseline, start_unbroken, worker_pids  # noqa: E402

from unbroken.api import make_config  # noqa: E402


def start_hsdp(tmp: Path, args: argparse.Namespace) -> Side:
    cfg = make_config(replicas=args.replicas, steps=LONG, microbatches=args.microbatches, launch__progress=False,
                      model__n_layer=args.n_layer, model__n_embd=args.n_embd, model__arch=args.model,
                      parallel__group_size=args.group_size,
                      exact=args.exact)
    return start_baseline("fsdp2 hsdp", _hsdp_baseline.start, cfg, tmp / "hsdp-times.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=float, default=4.0, help="s a side runs while the other is frozen")
    ap.add_argument("--settle", type=int, default=2, help="step intervals dropped after each thaw")
    ap.add_argument("--replicas", type=int, default=2, help="replica groups")
    ap.add_argument("--group-size", type=int, default=2, help="ranks per group")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt", help="the built-in model (model.arch)")
    ap.add_argument("--exact", action="store_true", help="unbroken in --exact (float64 reduce-scatter and sums)")
    args = ap.parse_args()
    console = Console(width=120)
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="hsdp-overhead-"))  # removed on success; kept when a run fails
    sides: list[Side] = []
    # unbroken's equal quotas: M/R microbatches a group, the baseline's split
    # on CPU as the baseline's mesh, also where a GPU is visible (parallel.device=auto would take it)
    extra = ["--run.quotas=equal", f"--parallel.group_size={args.group_size}", "--parallel.device=cpu",
             f"--model.arch={args.model}",
             *(["--exact"] if args.exact else [])]
    try:
        for name in ("unbroken", "fsdp2 hsdp"):
            with console.status(f"starting {name}"):
                side = start_hsdp(tmp, args) if name != "unbroken" else start_unbroken(name, tmp / name, args, *extra)
                sides.append(side)
                side.wait_steps(args.settle + 2)
                side.signal(signal.SIGSTOP)
        unb, base = sides
        for rnd in range(args.rounds):
            for side in ([unb, base] if rnd % 2 == 0 else [base, unb]):  # ABBA
                with console.status(f"round {rnd + 1}/{args.rounds}: {side.name}"):
                    side.run_window(args.window)
            # as it goes, so a run cut short (a time limit on a lent machine) still leaves its rounds; the
            # table re-reads the logs at the end, with step ends written after their window froze
            last = [s.window_intervals(args.settle)[-1] for s in (unb, base)]
            if all(last):
                console.print(f"round {rnd + 1}: {statistics.median(last[0]) / statistics.median(last[1]):.3f}")
        # each rank's high-water mark, read while the processes live (baseline: its rank processes)
        peaks = {s.name: peak_mib(worker_pids(tmp / "unbroken") if s is unb else {p.pid for p in s.procs})
                 for s in sides}
    finally:
        for side in sides:
            side.stop()
    per = {s.name: s.window_intervals(args.settle) for s in sides}
    if any(not w for s in sides for w in per[s.name]):
        raise RuntimeError(f"a window held fewer than {args.settle + 2} steps: raise --window (runs in {tmp})")
    med = {n: [statistics.median(w) for w in ws] for n, ws in per.items()}
    pooled = {n: statistics.median([x for w in ws for x in w]) for n, ws in per.items()}
    ratios = [a / b for a, b in zip(med["unbroken"], med["fsdp2 hsdp"])]
    cores = len(os.sched_getaffinity(0))
    t = Table(title=f"failure-free step time: {args.replicas} groups x {args.group_size} ranks on {cores} cores, "
                    f"{args.microbatches} microbatches/step, {args.model} {args.n_layer} x {args.n_embd}"
                    f"{', exact' if args.exact else ''}, {args.rounds} rounds of {args.window:g} s, time-sliced",
              title_justify="left")
    for col in ("system", "median step ms", "per-window medians ms", "intervals"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for s in sides:
        t.add_row(s.name, f"{1e3 * pooled[s.name]:.1f}", " ".join(f"{1e3 * x:.0f}" for x in med[s.name]),
                  str(sum(len(w) for w in per[s.name])))
    console.print(t)
    lo, hi = bootstrap_ci(ratios)
    console.print("unbroken / FSDP2 HSDP by round: " + " ".join(f"{x:.3f}" for x in ratios))
    console.print(f"pooled: {pooled['unbroken'] / pooled['fsdp2 hsdp']:.3f}; median of rounds "
                  f"{statistics.median(ratios):.3f} (95% bootstrap interval {lo:.3f}-{hi:.3f}); "
                  f"wall time {time.time() - t_start:.0f} s")
    cpu = {s.name: cpu_per_step(s, trainers) for s, trainers in
           ((unb, worker_pids(tmp / "unbroken")), (base, {p.pid for p in base.procs}))}
    cpu_table(console, cpu)
    trainer = {n: v["trainer main"] + v["trainer gloo"] + v["trainer threads"] for n, v in cpu.items()}
    console.print("control = the coordinator, launcher and torchrun agents: on a GPU node they run on host "
                  "cores the trainers do not use; here they take CPU from the trainers")
    shutil.rmtree(tmp, ignore_errors=True)
    main = {n: v["trainer main"] for n, v in cpu.items()}
    print(f"ratio hsdp_overhead_main_thread_cpu {main['unbroken'] / main['fsdp2 hsdp']:.3f}")
    print(f"ratio hsdp_overhead_trainer_cpu {trainer['unbroken'] / trainer['fsdp2 hsdp']:.3f}")
    print(f"ratio hsdp_overhead_total_cpu {sum(cpu['unbroken'].values()) / sum(cpu['fsdp2 hsdp'].values()):.3f}")
    console.print("peak resident memory per rank (VmHWM), MiB: " + ", ".join(
        f"{n} {statistics.median(v):.0f} (ranks {' '.join(f'{x:.0f}' for x in sorted(v))})" for n, v in peaks.items()))
    print(f"ratio hsdp_peak_memory {statistics.median(peaks['unbroken']) / statistics.median(peaks['fsdp2 hsdp']):.3f}")
    print(f"ratio hsdp_overhead {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
