"""The NCCL cross-group reduction's abort and re-form on a real GPU (benchmarks/gpu_check.sh, part `abort`).
NEVER RUN: written on a CPU-only machine for the first GPU session.

Three ranks (processes) on one GPU, each its own NCCL_HOSTID (device.py's docstring), one rank per GPU
where there are as many, through runtime/parallel/nccl.py's NcclEpochGroup:
  epoch 1, members 0 1 2: an all-reduce of ones gives 3 everywhere;
  epoch 2, members 0 1 2: rank 2 never issues (a hung peer); ranks 0 and 1 see the epoch move after 3 s,
    get EpochMoved, their communicator aborted from a watcher thread, their buffers intact;
  epoch 3, members 0 1: a fresh communicator on a fresh store prefix reduces to 2, as the survivors do;
  epoch 4, members 0 1: rank 1 never issues; rank 0's 2 s timeout gives CollectiveError.
Each rank prints one `ok` line per step or `FAILED ...`; the process exits 1 on any failure.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time


def rank_main(rank: int, port: int) -> int:
    os.environ["NCCL_HOSTID"] = f"abort-{rank}"  # before any NCCL call: ranks may share a GPU
    import torch
    import torch.distributed as dist

    from unbroken.runtime.parallel.collectives import CollectiveError, EpochMoved
    from unbroken.runtime.parallel.device import nccl_environment
    from unbroken.runtime.parallel.nccl import NcclEpochGroup

    nccl_environment(os.environ)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=120))
    failures = 0

    def check(what: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"rank {rank}: {'ok' if ok else 'FAILED'} {what} {detail}".rstrip(), flush=True)

    buf = torch.ones(1 << 20, device=dev)
    g1 = NcclEpochGroup(store, 1, (0, 1, 2), rank, 60.0, device=dev)
    r = g1.allreduce(buf, lambda: False)
    torch.cuda.synchronize()
    check("epoch 1 sums to 3", bool((r.tensor == 3).all()), f"{r.seconds:.3f} s")

    g2 = NcclEpochGroup(store, 2, (0, 1, 2), rank, 60.0, device=dev)
    if rank == 2:
        time.sleep(8)  # hung: never issues; its peers abort without it
        store.set("hung-done", "1")
        os._exit(0 if failures == 0 else 1)
    t0 = time.monotonic()
    try:
        g2.allreduce(buf, lambda: time.monotonic() - t0 > 3)
        check("epoch 2 raises EpochMoved", False, "it returned")
    except EpochMoved as e:
        check("epoch 2 raises EpochMoved", True, f"after {time.monotonic() - t0:.2f} s: {e}")
    check("buffer intact after the abort", bool((buf == 1).all()))

    g3 = NcclEpochGroup(store, 3, (0, 1), rank, 60.0, device=dev)
    r = g3.allreduce(buf, lambda: False)
    torch.cuda.synchronize()
    check("epoch 3 re-formed without rank 2 sums to 2", bool((r.tensor == 2).all()), f"{r.seconds:.3f} s")

    g4 = NcclEpochGroup(store, 4, (0, 1), rank, 2.0, device=dev)
    if rank == 1:
        # its communicator forms (the constructor's thread), and it never issues
        store.wait(["timeout-done"], datetime.timedelta(seconds=60))
        os._exit(0 if failures == 0 else 1)
    t0 = time.monotonic()
    try:
        g4.allreduce(buf, lambda: False)
        check("epoch 4 times out", False, "it returned")
    except CollectiveError as e:
        check("epoch 4 times out", True, f"after {time.monotonic() - t0:.2f} s: {e}")
    store.set("timeout-done", "1")
    store.wait(["hung-done"], datetime.timedelta(seconds=60))
    os._exit(0 if failures == 0 else 1)


def main() -> None:
    if len(sys.argv) == 3:
        rank_main(int(sys.argv[1]), int(sys.argv[2]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port)]) for r in range(3)]
    codes = [p.wait(timeout=240) for p in procs]
    print("abort check:", "ok" if not any(codes) else f"FAILED, exit codes {codes}")
    sys.exit(1 if any(codes) else 0)


if __name__ == "__main__":
    main()
