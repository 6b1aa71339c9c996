"""Issue 63's GPU figures, each a ratio measured in one run on a GPU machine (benchmarks/gpu_check.sh,
part `figures`). NEVER RUN: written on a CPU-only machine; the first GPU session runs it, fixes what breaks
and records the figures with date, device and command in benchmarks/RESULTS.md.

  ratio gpu_overhead            unbroken's median step interval, R one-rank groups on CUDA (cross-group
                                all-reduce on NCCL), over plain DDP on NCCL (benchmarks/_ddp_baseline.py),
                                same model, microbatches, GPU(s) and sharing; the two run one after the
                                other, twice, in ABBA order (a GPU machine is not shared)
  ratio nccl_group_over_plain   runtime/parallel/nccl.py's NcclEpochGroup.allreduce (copy, issue, poll)
                                over torch's all_reduce on a plain NCCL group of the same ranks, same bytes
  ratio gloo_over_nccl_group    collectives.EpochGroup (gloo, CUDA tensors staged through host memory)
                                over NcclEpochGroup, same ranks, same bytes: what cross_backend=auto gains

Not measured, not built yet (issue 63, items 2 and 1's heals): the device digest against the host digest,
and heal bandwidth on NCCL; the script says so in its output.

Several ranks on one GPU: each rank its own NCCL_HOSTID (device.py's docstring); one rank per GPU where
there are as many. Run: python benchmarks/gpu_figures.py [--replicas 3] [--mb 64] [--steps 30]
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_rank(rank: int, world: int, port: int, mb: int, repeats: int) -> None:
    """One rank of the collective figures: plain NCCL, NcclEpochGroup and gloo's EpochGroup, each timed
    `repeats` times on `mb` MB of float32 after 3 warm-ups; rank 0 prints the medians and ratios."""
    os.environ["NCCL_HOSTID"] = f"figures-{rank}"  # before any NCCL call: ranks may share a GPU
    import torch
    import torch.distributed as dist

    from unbroken.runtime.parallel.collectives import EpochGroup
    from unbroken.runtime.parallel.device import nccl_environment
    from unbroken.runtime.parallel.nccl import NcclEpochGroup

    nccl_environment(os.environ)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=dist.PrefixStore("plain/", store), rank=rank, world_size=world,
                            device_id=dev)
    buf = torch.randn(mb * 2**18, device=dev)  # mb MB of float32
    into = torch.empty_like(buf)
    members = tuple(range(world))
    ours = NcclEpochGroup(store, 1, members, rank, 120.0, device=dev)
    gloo = EpochGroup(store, 2, members, rank, 120.0)

    def plain() -> None:
        into.copy_(buf)  # the same copy unbroken's reduction makes
        dist.all_reduce(into)
        torch.cuda.synchronize()

    def timed(f) -> float:
        for _ in range(3):
            f()
        spans = []
        for _ in range(repeats):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            spans.append(time.perf_counter() - t0)
        return statistics.median(spans)

    t_plain = timed(plain)
    t_ours = timed(lambda: ours.allreduce(buf, lambda: False, into=into))
    t_gloo = timed(lambda: gloo.allreduce(buf, lambda: False, into=into))
    if rank == 0:
        print(f"{world} ranks on {torch.cuda.device_count()} GPU(s) ({torch.cuda.get_device_name(dev)}), {mb} MB: "
              f"plain NCCL {t_plain * 1e3:.2f} ms, NcclEpochGroup {t_ours * 1e3:.2f} ms, gloo {t_gloo * 1e3:.2f} ms")
        print(f"ratio nccl_group_over_plain {t_ours / t_plain:.3f}")
        print(f"ratio gloo_over_nccl_group {t_gloo / t_ours:.3f}")
    dist.barrier()
    os._exit(0)  # the groups' threads and sockets: as the trainer does


def collective_figures(world: int, mb: int, repeats: int) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--collective-rank", str(r), "--replicas", str(world),
                               "--port", str(port), "--mb", str(mb), "--repeats", str(repeats)])
             for r in range(world)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"collective figures failed: exit codes {codes}")


def median_interval(times: list[float], settle: int) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])][settle:]
    return statistics.median(gaps)


def overhead_figure(replicas: int, steps: int, microbatches: int, n_layer: int, n_embd: int) -> None:
    import _ddp_baseline

    from unbroken.api import make_config
    from unbroken.events import read_events

    cfg = make_config(replicas=replicas, steps=steps, microbatches=microbatches, launch__progress=False, quotas="equal",
                      model__n_layer=n_layer, model__n_embd=n_embd)
    env = {**os.environ, "UNBROKEN_NCCL_HOSTID_PER_RANK": "1"}
    ours, ddp = [], []
    with tempfile.TemporaryDirectory(prefix="gpu-figures-") as tmp:
        for n, side in enumerate("ABBA"):
            if side == "A":
                out = Path(tmp) / f"unbroken{n}"
                subprocess.run([sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(replicas),
                                "--steps", str(steps), "--microbatches", str(microbatches), "--run.quotas=equal",
                                f"--model.n_layer={n_layer}", f"--model.n_embd={n_embd}", "--launch.progress=false",
                                "--parallel.device=cuda", "--parallel.cross_backend=nccl", "--out", str(out)],
                               env=env, check=True, timeout=900)
                starts = [e for e in read_events(out / "events.jsonl") if e["event"] == "worker_start"]
                assert all(e["cross_backend"] == "nccl" and e["device"].startswith("cuda") for e in starts), starts
                ours.append(median_interval([e["t"] for e in read_events(out / "events.jsonl")
                                             if e["event"] == "step"], 5))
            else:
                ddp.append(median_interval(_ddp_baseline.spawn(cfg, free_port(), 900, device="cuda"), 5))
    a, b = statistics.median(ours), statistics.median(ddp)
    print(f"{replicas} one-rank groups, GPT {n_layer} x {n_embd}, {microbatches} microbatches: unbroken "
          f"{a * 1e3:.1f} ms a step, DDP on NCCL {b * 1e3:.1f} ms (runs: {ours}, {ddp})")
    print(f"ratio gpu_overhead {a / b:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--mb", type=int, default=64, help="MB reduced in the collective figures")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=6)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--only", choices=("collective", "overhead"), help="one group of figures")
    ap.add_argument("--collective-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.collective_rank is not None:
        collective_rank(a.collective_rank, a.replicas, a.port, a.mb, a.repeats)
        return
    if a.only != "overhead":
        collective_figures(a.replicas, a.mb, a.repeats)
    if a.only != "collective":
        overhead_figure(a.replicas, a.steps, a.microbatches, a.n_layer, a.n_embd)
    print("figure device_digest_over_host_digest: not built (issue 63 item 2: the digest is on the host)")
    print("figure heal_nccl_over_plain_send: not built (heals and restores run on gloo)")


if __name__ == "__main__":
    main()
