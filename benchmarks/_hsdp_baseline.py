"""The plain-PyTorch baseline for benchmarks/hsdp_overhead.py: FSDP2 HSDP on gloo, nothing else.

What a torchtitan user would run without unbroken, doing the same work as unbroken's replica groups: a
2-D mesh (replicate R, shard G) over R x G processes, `fully_shard` on each block and the root (as
unbroken's `parallelize`), the same GPT and seed, the same microbatches (M a step, replica r computing the
contiguous block M/R * r .. M/R * (r+1) - 1, each rank its share of every microbatch's sequences through
the data API's `part`), the same SUM reduction with token loss weights, gradient sync only on a replica's
last microbatch (`set_requires_gradient_sync`), AdamW, one torch thread a process. No fault tolerance.
With `run.exact` FSDP2 reduces in float64 (`MixedPrecisionPolicy(reduce_dtype=torch.float64)`): the same
reduce bytes as unbroken's exact mode, whose float64 reduce-scatter is the cost of bitwise results.

`start(cfg, port, times)` starts the R x G processes (this file as a script, one per rank, joining through
a TCPStore rendezvous as torchrun would give them); rank 0 appends its wall-clock time after each optimizer
step to `times`, a line a step.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from unbroken.config import Config


def start(cfg: Config, port: int, times: Path) -> list[subprocess.Popen]:
    """Start run.replicas x parallel.group_size rank processes; rank 0 appends time.time() after each step."""
    R, G, M = cfg.run.replicas, cfg.parallel.group_size, cfg.run.microbatches
    if M % R:
        raise ValueError(f"{M} microbatches do not split evenly across {R} replicas")
    conf = times.with_suffix(".config.json")
    conf.write_text(cfg.to_json())
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--config", str(conf),
                              "--out", str(times)], env=env, stdin=subprocess.DEVNULL) for r in range(R * G)]


def rank_main(rank: int, port: int, cfg: Config, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from unbroken.model.data import DataSource, mix, part, seed_microbatch
    from unbroken.model.builtin import built_in
    from unbroken.policy.workload import loss_weight

    R, G, M = cfg.run.replicas, cfg.parallel.group_size, cfg.run.microbatches
    torch.set_num_threads(cfg.run.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R * G)
    mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(cfg.run.seed)
    model = built_in(cfg.model)  # the GPT or the Llama (model.arch), as unbroken's side builds it
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64) if cfg.run.exact else MixedPrecisionPolicy()
    blocks = model.layers if cfg.model.arch == "llama" else model.blocks  # torchtitan's units: each block, the root
    for m in [*blocks.values(), model]:
        fully_shard(m, mesh=mesh, mp_policy=mp)
        m.set_force_sum_reduction_for_comms(True)  # gloo: a SUM, as unbroken's (REFERENCE.md)
        m.set_gradient_divide_factor(1.0)
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    replica, share = divmod(rank, G)
    per = M // R
    model.train()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if rank == 0 else -1
    dist.barrier()
    for step in range(cfg.run.steps):
        step_tokens = data.step_tokens(step, M)
        for n, i in enumerate(range(replica * per, (replica + 1) * per)):
            mb = part(data.microbatch(step, i), share, G)
            seed_microbatch(mix(cfg.run.seed, step, i))
            model.set_requires_gradient_sync(n == per - 1)
            (model(mb.x, mb.y) * loss_weight(mb.tokens, step_tokens)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            os.write(fd, f"{time.time():.6f}\n".encode())
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # REFERENCE.md: about 1 run in 4 aborted in gloo's destructors after destroy_process_group


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="one rank of the FSDP2 HSDP baseline")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rank_main(a.rank, a.port, Config.from_json(a.config.read_text()), a.out)
