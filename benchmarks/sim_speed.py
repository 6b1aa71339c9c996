"""How long the simulator takes: every strategy of each scenario, one run each.

Usage: python benchmarks/sim_speed.py [--scenario FILE ...] [--seed K] [--check-determinism]
Default scenario: scenarios/llama3_16k.toml (16,384 GPUs, 54 days). Targets: under 15 s for every strategy of
llama3_16k together, under 60 s for llama3_131k.toml (131,072 GPUs), on this 2-core machine. The engine jumps
over failure-free stretches in closed form; it never loops per step or per GPU.

Prints per strategy: wall and process CPU seconds (the host is shared: CPU time is the steadier figure),
steps, tokens (x the first strategy's), GPU-hours lost; then per scenario the load average, the detector's
coverage (from the run_start record) and `ratio sim_seconds` (wall seconds of all strategies together;
`cpu_seconds` beside it). With --check-determinism, each strategy runs twice and the two logs' sha256 must
agree (printed). Leaves out: process start and imports, writing logs to disk (records stay in memory).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import STRATEGIES

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "llama3_16k.toml"


def run_scenario(path: Path, seed: int, check: bool) -> bool:
    sc = load(path)
    print(f"== {sc.name}: {sc.cluster.gpus:,} GPUs (DP {sc.cluster.dp} x TP {sc.cluster.tp} x PP {sc.cluster.pp}), "
          f"{sc.workload.duration_hours:g} h, seed {seed}; load average {os.getloadavg()[0]:.2f} at start")
    wall = cpu = 0.0
    ref, ok, coverage = None, True, None
    for name in STRATEGIES:
        w, c = time.perf_counter(), time.process_time()
        res = simulate(sc, name, seed, keep=True)
        dw, dc = time.perf_counter() - w, time.process_time() - c
        wall, cpu = wall + dw, cpu + dc
        end, start = res.end, res.records[0]
        coverage = coverage or (start.get("detector_coverage") and
                                f"{start['detector_coverage']}: {start['detector_approximation']}")
        ref = ref or end["tokens"]
        lost = sum(end["lost_gpu_hours"].values())
        same = ""
        if check:
            again = simulate(sc, name, seed).digest
            ok &= again == res.digest
            same = f"  sha256 {res.digest[:12]} {'same' if again == res.digest else 'DIFFERS: ' + again[:12]}"
        print(f"{name:20s} {dw:6.2f} s wall {dc:6.2f} s cpu  steps {end['steps_committed']:>8d}  "
              f"tokens {end['tokens']:.4g} ({end['tokens'] / ref:.3f}x)  GPU-h lost {lost:,.0f}{same}", flush=True)
    print(f"chosen: {', '.join(sc.chosen)}")
    print(f"detector coverage: {coverage}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(f"ratio sim_seconds {wall:.3f} cpu_seconds {cpu:.3f} ({sc.name})")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", action="append", type=Path, default=None, help="scenario TOML, repeatable")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-determinism", action="store_true", help="run each strategy twice, compare logs")
    args = ap.parse_args()
    ok = all([run_scenario(p, args.seed, args.check_determinism) for p in args.scenario or [SCENARIO]])
    if args.check_determinism:
        print("determinism: " + ("every log identical across two runs" if ok else "LOGS DIFFER"))
        raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
