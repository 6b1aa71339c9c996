"""How long the simulator takes: every strategy of each scenario, one run each.

Usage: python benchmarks/sim_speed.py [--scenario FILE ...] [--seed K] [--jobs N] [--check-determinism]
Default scenario: scenarios/llama3_16k.toml (16,384 GPUs, 54 days). Targets: under 15 s for every strategy of
llama3_16k together, under 60 s for llama3_131k.toml (131,072 GPUs), on this 2-core machine. The engine jumps
over failure-free stretches in closed form; it never loops per step or per GPU.

Prints per strategy: wall and process CPU seconds (the host is shared: CPU time is the steadier figure),
steps, tokens (x the first strategy's), GPU-hours lost; then per scenario the load average, the detector's
coverage (from the run_start record) and `ratio sim_seconds` (wall seconds of all strategies together;
`cpu_seconds` beside it). With --check-determinism, each strategy runs twice and the two logs' sha256 must
agree (printed). With --jobs N (default 1) the strategies run in N worker processes, longest first: the
strategies are independent runs, so the wall time of all of them falls toward the longest one's (each
strategy's own figures are then measured inside its worker). Leaves out: process start and imports,
writing logs to disk (records stay in memory).
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import STRATEGIES

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "llama3_16k.toml"


LONGEST_FIRST = ("unbroken_replan", "unbroken_detect", "detect_only")  # the detector's runs take the most


def one(path: Path, name: str, seed: int, check: bool) -> tuple[float, float, dict, dict, str, bool]:
    """One strategy: (wall s, CPU s, run_end, run_start, sha256, same log on a second run)."""
    sc = load(path)
    w, c = time.perf_counter(), time.process_time()
    res = simulate(sc, name, seed, keep=True)
    dw, dc = time.perf_counter() - w, time.process_time() - c
    same = simulate(sc, name, seed).digest == res.digest if check else True
    return dw, dc, res.end, res.records[0], res.digest, same


def run_scenario(path: Path, seed: int, check: bool, jobs: int) -> bool:
    sc = load(path)
    print(f"== {sc.name}: {sc.cluster.gpus:,} GPUs (DP {sc.cluster.dp} x TP {sc.cluster.tp} x PP {sc.cluster.pp}), "
          f"{sc.workload.duration_hours:g} h, seed {seed}, {jobs} job(s); load average {os.getloadavg()[0]:.2f} at start")
    order = [n for n in LONGEST_FIRST if n in STRATEGIES] + [n for n in STRATEGIES if n not in LONGEST_FIRST]
    t0 = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            futures = {n: pool.submit(one, path, n, seed, check) for n in order}
            results = {n: f.result() for n, f in futures.items()}
    else:
        results = {n: one(path, n, seed, check) for n in STRATEGIES}
    wall = time.perf_counter() - t0
    cpu, ref, ok, coverage = 0.0, None, True, None
    for name in STRATEGIES:
        dw, dc, end, start, digest, same = results[name]
        cpu += dc
        ok &= same
        coverage = coverage or (start.get("detector_coverage") and
                                f"{start['detector_coverage']}: {start['detector_approximation']}")
        ref = ref or end["tokens"]
        lost = sum(end["lost_gpu_hours"].values())
        tail = f"  sha256 {digest[:12]} {'same' if same else 'DIFFERS'} on a second run" if check else ""
        print(f"{name:20s} {dw:6.2f} s wall {dc:6.2f} s cpu  steps {end['steps_committed']:>8d}  "
              f"tokens {end['tokens']:.4g} ({end['tokens'] / ref:.3f}x)  GPU-h lost {lost:,.0f}{tail}", flush=True)
    print(f"chosen: {', '.join(sc.chosen)}")
    print(f"detector coverage: {coverage}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(f"ratio sim_seconds {wall:.3f} cpu_seconds {cpu:.3f} ({sc.name}, {jobs} job(s); with --check-determinism "
          "the wall clock includes the second runs)")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", action="append", type=Path, default=None, help="scenario TOML, repeatable")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-determinism", action="store_true", help="run each strategy twice, compare logs")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for the strategies (default 1)")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    ok = all([run_scenario(p, args.seed, args.check_determinism, args.jobs) for p in args.scenario or [SCENARIO]])
    if args.check_determinism:
        print("determinism: " + ("every log identical across two runs" if ok else "LOGS DIFFER"))
        raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
