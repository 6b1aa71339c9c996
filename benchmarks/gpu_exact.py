"""Are a microbatch's gradients the same bits every time it is computed on this GPU, and what does
`--exact`'s choice of kernels (runtime/parallel/device.py: exact_kernels) cost?

`--exact` promises that a microbatch redone by a survivor yields the gradient the lost replica would
have: that holds only if the kernels give the same bits for the same inputs. This computes one
microbatch's forward and backward `--repeats` times in a fresh process per mode and counts the distinct
gradient digests, and times each pass (CUDA-synchronized, after a warm-up):

- `default`: torch's kernels as they come;
- `deterministic`: torch's deterministic algorithms and cuBLAS's fixed workspace only;
- `exact`: exact_kernels, what a trainer does under --exact on CUDA (the above plus SDPA's math backend).

Two model sizes: the run's default GPT (2 layers, width 64, 4 x 64 tokens) and a wider one (4 layers,
width 512, 16 x 256 tokens), where more tokens share each embedding row's atomic additions. Needs CUDA
(on a CPU it runs and says so: every CPU kernel here is deterministic). The last line is
`ratio exact_kernels_time V`: the wider model's median pass under `exact` over `default`, one run. It
leaves out everything but one rank's forward and backward: no optimizer, no collectives.

    python benchmarks/gpu_exact.py [--repeats 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = {"default": dict(), "wide": dict(n_layer=4, n_embd=512, n_head=8, block_size=256)}
BATCH = {"default": (4, 64), "wide": (16, 256)}  # sequences, tokens each


def measure(mode: str, size: str, repeats: int) -> dict:
    """One mode and size, in this process (the modes' switches are process-wide)."""
    import torch

    from unbroken.config import DataConfig, ModelConfig
    from unbroken.model.data import DataSource, mix, seed_microbatch
    from unbroken.model.gpt import GPT
    from unbroken.runtime.parallel.accumulator import param_digest
    from unbroken.runtime.parallel.device import exact_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if mode == "exact":
        exact_kernels(device)
    elif mode == "deterministic" and device.type == "cuda":  # exact_kernels without its math SDPA
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    cfg = ModelConfig(**SIZES[size])
    model = GPT(cfg).to(device)
    rows, tokens = BATCH[size]
    mb = DataSource(DataConfig(batch_size=rows, seq_len=str(tokens)), cfg.block_size, 0).microbatch(3, 1)
    x, y = mb.x.to(device), mb.y.to(device)
    digests, seconds = [], []
    for n in range(repeats + 1):  # the first pass warms up (kernel choice, allocator): not timed
        model.zero_grad(set_to_none=True)
        seed_microbatch(mix(0, 3, 1))  # dropout: the same draws each pass, as a redone microbatch
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x, y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if n:
            seconds.append(time.perf_counter() - t)
        digests.append(param_digest([p.grad for p in model.parameters()]))  # the bytes runs compare
    return dict(mode=mode, size=size, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                distinct=len(set(digests)), passes=len(digests), median_ms=1e3 * statistics.median(seconds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "SIZE"), help=argparse.SUPPRESS)  # a child's job
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.repeats)))
        return 0
    results = {}
    for size in SIZES:
        for mode in ("default", "deterministic", "exact"):
            p = subprocess.run([sys.executable, __file__, "--one", mode, size, "--repeats", str(args.repeats)],
                               capture_output=True, text=True)
            if p.returncode:
                print(f"{size} {mode}: failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = results[size, mode] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{size:8s} {mode:14s} on {r['device']}: {r['distinct']} distinct gradient digest(s) over "
                  f"{r['passes']} passes, median pass {r['median_ms']:.2f} ms")
    if ("wide", "exact") in results and ("wide", "default") in results:
        print(f"ratio exact_kernels_time {results['wide', 'exact']['median_ms'] / results['wide', 'default']['median_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
