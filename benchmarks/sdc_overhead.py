"""Failure-free cost of the silent-corruption checks at their defaults against none (`ratio sdc_overhead`).

The checks (docs/corruption.md): the state agreement check (detect.state_every, default 8: after every 8th
committed step each rank hashes its parameters and AdamW moments, publishes the digest, reads its peers')
and the finite check (detect.finite_check, default on: one float64 sum over the group's own gradient
sum before it is reduced, every step).

Two figures, both at one model size (default the 10.7M GPT, 6 x 384, as benchmarks/overhead.py's):
1. The checks' own CPU, in this process, on that model's real state: one state digest (XXH3-128 over the
   parameters and both AdamW moments) and one finite check of the float64 accumulator (--exact's; a
   float32 one is half of it), against one step's forward/backward (M/R microbatches of the default
   shape); `ratio sdc_check_cpu` = (step + digest / state_every + finite) / step. What it leaves out: the
   store round trips of a check (a set and a multi_get, ~0.1 ms each locally) and the wait at the check
   for the slowest member, which a step's commit already waits for.
2. End to end, through the CLI: runs with the defaults and runs with `--detect.state_every=0
   --detect.finite_check=false`, alternated A B B A ..., each --steps steps of --replicas replicas on
   gloo; a run's figure is the median interval between its step records after the first --skip; the
   ratio is the median over pairs of (checked / unchecked). `ratio sdc_overhead` is that figure. On a
   shared 2-core host the noise between runs is several percent, more than the checks cost: read it with
   the spread printed beside it, and the CPU figure above as the one a loaded host moves little.

Usage: python benchmarks/sdc_overhead.py [--n-layer 6] [--n-embd 384] [--pairs 2] [--steps 10]
       [--replicas 2] [--microbatches 4] [--skip 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from unbroken.config import Config  # noqa: E402
from unbroken.config.schema import DetectSection, ModelConfig  # noqa: E402
from unbroken.model.gpt import GPT  # noqa: E402
from unbroken.runtime.persist.healing import state_tensors  # noqa: E402
from unbroken.runtime.trainer.agreement import state_digest  # noqa: E402


def median_seconds(f, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.thread_time()
        f()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def cpu_figures(args) -> float:
    torch.set_num_threads(1)
    cfg = Config()
    model = GPT(ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=max(1, args.n_embd // 64),
                            dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, t = cfg.data.batch_size, ModelConfig().block_size
    x = torch.randint(0, 256, (b, t))

    def microbatch():
        model(x, x).backward()

    microbatch()
    opt.step()  # AdamW's moments exist: the state a check hashes
    tensors = state_tensors(model, opt)
    numel = sum(p.numel() for p in model.parameters())
    acc = torch.zeros(numel + 1, dtype=torch.float64)
    digest = median_seconds(lambda: state_digest(tensors), 5)
    finite = median_seconds(lambda: bool(torch.isfinite(acc.sum(dtype=torch.float64))), 5)
    mb = median_seconds(microbatch, 3)
    per_replica = max(1, args.microbatches // args.replicas)
    step = mb * per_replica
    every = DetectSection().state_every
    ratio = (step + digest / every + finite) / step
    state_mb = sum(t.numel() for t in tensors) * 4 / 2**20
    print(f"model {args.n_layer} x {args.n_embd}: {numel / 1e6:.1f}M parameters, {state_mb:.0f} MiB of "
          f"parameters and AdamW moments a replica")
    print(f"CPU s: state digest {digest * 1e3:.1f} ms (every {every} steps), finite check (float64) "
          f"{finite * 1e3:.2f} ms a step, forward/backward {mb * 1e3:.0f} ms a microbatch x {per_replica}")
    print(f"ratio sdc_check_cpu {ratio:.4f}")
    return ratio


def run(args, checked: bool) -> float:
    out = Path(tempfile.mkdtemp(prefix="sdc-"))
    extra = [] if checked else ["--detect.state_every=0", "--detect.finite_check=false"]
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(args.replicas), "--steps",
           str(args.steps), "--microbatches", str(args.microbatches), f"--model.n_layer={args.n_layer}",
           f"--model.n_embd={args.n_embd}", f"--model.n_head={max(1, args.n_embd // 64)}",
           "--run.progress=false", "--parallel.device=cpu", "--coord.heartbeat_timeout=30",
           "--coord.progress_timeout=600", "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"run failed: {r.stderr[-1500:]}")
    ts = sorted(json.loads(line)["t"] for line in (out / "events.jsonl").read_text().splitlines()
                if '"event":"step"' in line.replace(" ", ""))
    gaps = [b - a for a, b in zip(ts, ts[1:])][args.skip:]
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args()
    cpu_figures(args)
    ratios = []
    for n in range(args.pairs):  # A B, then B A: drift falls on both alike
        order = (True, False) if n % 2 == 0 else (False, True)
        got = {checked: run(args, checked) for checked in order}
        ratios.append(got[True] / got[False])
        print(f"pair {n}: checked {got[True] * 1e3:.0f} ms a step, unchecked {got[False] * 1e3:.0f} ms: "
              f"{ratios[-1]:.3f}")
    print(f"end to end: {args.replicas} replicas x {args.steps} steps, median over {len(ratios)} pairs "
          f"(spread {min(ratios):.3f}-{max(ratios):.3f}); leaves out nothing the run does")
    print(f"ratio sdc_overhead {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
