"""The work unbroken does once per parameter per step, in bytes and CPU ms, against the model's own step.

What it measures, in one process, one torch thread (a trainer's setting), on the GPT of --n-layer x
--n-embd: each piece of per-parameter work a replica does in a failure-free step, by unbroken's own code,
timed with the thread's CPU clock (median of --reps calls after a warm-up), beside one microbatch's
forward and backward (4 x 64 tokens by default, the data config's and overhead.py's):
  digest          param_digest of every parameter (the `applied` event's and the step record's)
  reduce copy     the all-reduce's copy of the accumulator (float32; float64 under --exact)
  exact first     --exact: a step's first microbatch into the float64 accumulator: `zero` leaves its
                  slices unset and the fold writes 0.0 + g (the zeroing pass and one read saved)
  exact fold      --exact: each later microbatch's float32 gradients added into the float64 accumulator
  exact load      --exact: the reduced float64 buffer into float32 `.grad` (Accumulator.load_grads: one
                  copy into a kept float32 buffer; "a fresh": a new tensor per parameter, as it was)
  rollback save   commit pipelining: the copy of parameters and AdamW state before a step ahead
  event           one EventLog.emit (a step writes ~M/R + 3 of them, none per parameter)
Prints a table, then `cost NAME bytes=B ms=T per_step=K` lines (K: how many a replica does a step with
--microbatches M over --replicas R) and last `ratio per_param_work_exact V`: everything an --exact
replica does per parameter a step over its forward/backward of M/R microbatches (`..._float32`, the
same without the exact rows, printed before it). The figures are this host's and its load's.
Usage: python benchmarks/per_param_cpu.py [--n-layer 6] [--n-embd 384] [--reps 9]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from unbroken.config.schema import ModelConfig
from unbroken.events import EventLog
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.accumulator import Accumulator, param_digest, unique_parameters
from unbroken.runtime.trainer.speculation import Rollback


def cpu_ms(f, reps: int) -> float:
    """Median thread-CPU ms of f() over `reps` calls, after one warm-up call."""
    f()
    times = []
    for _ in range(reps):
        t = time.thread_time()
        f()
        times.append(1e3 * (time.thread_time() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.seq, dropout=0.0))
    params = unique_parameters(model)
    numel = sum(p.numel() for p in params)
    x = torch.randint(0, 256, (args.batch, args.seq))

    def fwd_bwd() -> None:
        model(x, x).backward()
    fb = cpu_ms(fwd_bwd, max(3, args.reps // 3))
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()  # AdamW's state exists, as after a first step
    acc32, acc64 = Accumulator(params, torch.float32), Accumulator(params, torch.float64)
    into32, into64 = torch.empty_like(acc32.buffer), torch.empty_like(acc64.buffer)
    grads = [torch.randn_like(p) for p in params]

    def fold() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        acc64.add(torch.zeros(()))

    def first() -> None:  # the step's start and its first microbatch
        acc64.zero()
        fold()
    def fresh(reduced: torch.Tensor) -> None:  # a float32 tensor per parameter a step, as load_grads did
        for p, view in zip(params, acc64._split(reduced)):
            p.grad = view.to(p.dtype)
    rollback = Rollback(params, opt, 1 << 62)
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(Path(tmp) / "events.jsonl", who="replica0")
        per_step = args.microbatches // args.replicas
        rows = [  # name, bytes moved, ms, times a step, exact only
            ("digest", 4 * numel, cpu_ms(lambda: param_digest(params), args.reps), 1, False),
            ("reduce copy float32", 8 * numel, cpu_ms(lambda: into32.copy_(acc32.buffer), args.reps), 1, False),
            ("reduce copy float64", 16 * numel, cpu_ms(lambda: into64.copy_(acc64.buffer), args.reps), 1, True),
            ("exact first", 12 * numel, cpu_ms(first, args.reps), 1, True),
            ("exact fold", 20 * numel, cpu_ms(fold, args.reps), per_step - 1, True),
            ("exact load", 12 * numel, cpu_ms(lambda: acc64.load_grads(into64), args.reps), 1, True),
            ("exact load, a fresh", 12 * numel, cpu_ms(lambda: fresh(into64), args.reps), 0, True),
            ("rollback save", 24 * numel, cpu_ms(rollback.save, args.reps), 1, False),
            ("event", 0, cpu_ms(lambda: log.emit("compute", step=1, replica=0, microbatch=3, seconds=0.1), args.reps),
             per_step + 3, False),
        ]
    print(f"GPT {args.n_layer} x {args.n_embd}: {numel / 1e6:.1f}M parameters; forward/backward of one "
          f"{args.batch} x {args.seq} microbatch {fb:.1f} CPU ms, {per_step} a replica's step")
    print(f"{'work':<22}{'bytes':>14}{'CPU ms':>10}{'a step':>8}{'ms a step':>11}{'GB/s':>8}")
    for name, nbytes, ms, k, _ in rows:
        print(f"{name:<22}{nbytes:>14,}{ms:>10.2f}{k:>8}{ms * k:>11.2f}{nbytes / ms / 1e6 if ms else 0:>8.1f}")
    for name, nbytes, ms, k, _ in rows:
        print(f"cost {name.replace(' ', '_')} bytes={nbytes} ms={ms:.3f} per_step={k}")
    step = fb * per_step
    # float32 mode without commit pipelining (auto turns it off at this size on a CPU): digest, copy, events
    f32 = sum(ms * k for name, _, ms, k, exact in rows if not exact and name != "rollback save")
    exact = f32 - rows[1][2] + sum(ms * k for _, _, ms, k, ex in rows if ex)
    print(f"ratio per_param_work_float32 {f32 / step:.4f}")
    print(f"ratio per_param_work_exact {exact / step:.4f}")


if __name__ == "__main__":
    main()
