"""The Llama 3 scenario (16,384 GPUs, 54 days) under every strategy: how long the simulator takes.

Usage: python benchmarks/sim_speed.py [--seed K]
Target: under 60 s for all strategies on a 2-core machine (the engine jumps over failure-free stretches
in closed form; it never loops per step or per GPU). Prints each strategy's tokens and GPU-hours lost.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import STRATEGIES

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "llama3_16k.toml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    seed = ap.parse_args().seed
    sc = load(SCENARIO)
    t0 = time.perf_counter()
    ref = None
    for name in STRATEGIES:
        t = time.perf_counter()
        end = simulate(sc, name, seed).end
        ref = ref or end["tokens"]
        lost = sum(end["lost_gpu_hours"].values())
        print(f"{name:20s} {time.perf_counter() - t:6.2f} s  steps {end['steps_committed']:>8d}  "
              f"tokens {end['tokens']:.4g} ({end['tokens'] / ref:.3f}x)  GPU-h lost {lost:,.0f}  "
              f"steps with another batch {end['steps_batch_differs']}")
    print(f"chosen: {', '.join(sc.chosen)}")
    print(f"ratio sim_seconds {time.perf_counter() - t0:.3f}")


if __name__ == "__main__":
    main()
