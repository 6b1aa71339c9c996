"""The plain-PyTorch baseline for benchmarks/overhead.py: DistributedDataParallel on gloo, nothing else.

What a user would write without unbroken, doing the same work as an unbroken replica: the same GPT
(`unbroken.model.gpt.GPT(cfg.model)`, same seed, so the same initial parameters), the same microbatches
(`DataSource.microbatch(step, i)`, same per-microbatch dropout seed and token loss weights), the same
global batch (M microbatches a step, rank r computes the contiguous block M/R * r .. M/R * (r+1) - 1),
gradient accumulation under `no_sync()` for all but the last microbatch, AdamW with the same
hyper-parameters, one torch thread per process. No fault tolerance: a dead rank hangs or crashes the rest.

`start(cfg, port, times)` starts R real processes (`python _ddp_baseline.py --rank r ...`, each imports torch
and joins through a TCPStore rendezvous, as torchrun would give them); rank 0 appends its wall-clock time
after each optimizer step to the file `times`, a line a step, as it goes (as unbroken's step records
do). `spawn(cfg, port)` runs them to the end and returns those times. Run as a script it is one rank.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unbroken.config import Config


def start(cfg: Config, port: int, times: Path, device: str = "cpu") -> list[subprocess.Popen]:
    """Start cfg.run.replicas rank processes; rank 0 appends time.time() after each step to `times`.
    device="cuda": DDP on NCCL, rank r on GPU r modulo the GPUs, each rank its own NCCL_HOSTID so that
    ranks may share a GPU (benchmarks/gpu_check.sh; never run yet)."""
    R, M = cfg.run.replicas, cfg.run.microbatches
    if M % R:
        raise ValueError(f"{M} microbatches do not split evenly across {R} processes")
    conf = times.with_suffix(".config.json")
    conf.write_text(cfg.to_json())
    # the same environment unbroken's launcher gives its workers: one OpenMP thread each
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(R), "--port", str(port),
                              "--config", str(conf), "--out", str(times), "--device", device],
                             env={**env, "NCCL_HOSTID": f"ddp-baseline-{r}"} if device == "cuda" else env,
                             stdin=subprocess.DEVNULL)
            for r in range(R)]


def spawn(cfg: Config, port: int, timeout_s: float = 600.0, device: str = "cpu") -> list[float]:
    """Run the baseline with cfg.run.replicas processes; returns rank 0's time.time() after each step."""
    with tempfile.TemporaryDirectory(prefix="ddp-baseline-") as tmp:
        out = Path(tmp) / "times.txt"
        procs = start(cfg, port, out, device)
        try:
            deadline = time.time() + timeout_s
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"DDP baseline failed: exit codes {codes}")
        return [float(x) for x in out.read_text().split()]


def rank_main(rank: int, world: int, port: int, cfg: Config, out: Path, device: str = "cpu") -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.model.data import DataSource, mix, seed_microbatch
    from unbroken.model.gpt import GPT
    from unbroken.model.optim import default_optimizer, lr_factor, mark_no_decay
    from unbroken.policy.workload import loss_weight

    torch.set_num_threads(cfg.run.threads)
    on = torch.device("cpu")
    if device == "cuda":
        on = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(on)
    dist.init_process_group("nccl" if on.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    torch.manual_seed(cfg.run.seed)  # identical initial parameters on every rank (DDP also broadcasts them)
    model = DDP(GPT(cfg.model).to(on))
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed)
    o = cfg.optim
    mark_no_decay(model.module, o)  # the same parameter groups, schedule and clipping as unbroken's step
    opt = default_optimizer(list(model.parameters()), cfg)
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    M = cfg.run.microbatches
    per = M // world
    mine = range(rank * per, (rank + 1) * per)
    model.train()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if rank == 0 else -1
    dist.barrier()  # start the clock together, as unbroken's replicas start step 0 together
    for step in range(cfg.run.steps):
        step_tokens = data.step_tokens(step, M)
        for n, i in enumerate(mine):
            mb = data.microbatch(step, i)
            seed_microbatch(mix(cfg.run.seed, step, i))
            # DDP averages over ranks; x world turns that back into unbroken's token-weighted sum
            sync = n == per - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = model(mb.x.to(on), mb.y.to(on)) * (loss_weight(mb.tokens, step_tokens) * world)
                loss.backward()
        if o.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm, foreach=True)
        factor = lr_factor(step, o, cfg.run.steps)
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * factor
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on.type == "cuda":
            torch.cuda.synchronize()  # the step's time is the GPU's, as unbroken's records (digest) wait for it
        if rank == 0:
            os.write(fd, f"{time.time():.6f}\n".encode())
    dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="one rank of the DDP baseline")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    rank_main(a.rank, a.world, a.port, Config.from_json(a.config.read_text()), a.out, a.device)
