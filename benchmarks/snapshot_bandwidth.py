"""Snapshot copy bandwidth over a plain memcpy of the same bytes.

A state of params + AdamW's two moments (fp32) is saved through SnapshotClient.save_async/wait into
a running snapshot agent's pre-faulted /dev/shm slot; the baseline copies the same tensors into
pre-allocated (pre-faulted) ordinary memory, with torch's copy_ and with glibc memcpy (ctypes,
one thread), and the faster of the two is the memcpy figure. Best of --reps for each.
Usage: python benchmarks/snapshot_bandwidth.py [--size-gb 1.2] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import shutil
import time
import uuid
from pathlib import Path

import torch
from torch.distributed import TCPStore

from unbroken.runtime.snapshot import AgentSpec, SnapshotClient, Topology, start_agent, stop_agent


def adamw_state(size_bytes: int) -> dict[str, torch.Tensor]:
    n = size_bytes // 12  # fp32 param + exp_avg + exp_avg_sq
    return {k: torch.rand(n) for k in ("param", "exp_avg", "exp_avg_sq")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.2)
    p.add_argument("--quick", action="store_true", help="64 MB state")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    size = int((0.064 if a.quick else a.size_gb) * 1e9)
    st = adamw_state(size)
    nbytes = sum(t.numel() * 4 for t in st.values())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=120))
    shm, run = Path("/dev/shm") / f"unbroken-bench-{uuid.uuid4().hex[:8]}", "bench"
    agent = start_agent(AgentSpec(f"127.0.0.1:{store.port}", run, 0, Topology(1, 1, "none"),
                                  str(shm)), store=store)
    try:
        c = SnapshotClient(store, run_id=run, rank=0, world=1, shm_dir=str(shm), timeout_s=120)
        t0 = time.perf_counter()
        c.save(0, st, {"step": 0})  # first save: the agent creates and pre-faults the slots
        first = time.perf_counter() - t0
        c.wait_committed(0)
        snap = []
        for step in range(1, a.reps + 1):
            t0 = time.perf_counter()
            c.save_async(step, st, {"step": step})
            returned = time.perf_counter() - t0
            c.wait()
            snap.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            c.wait_committed(step, timeout_s=120)
            commit = time.perf_counter() - t1
        dst = {k: torch.empty_like(v) for k, v in st.items()}
        for k in st:
            dst[k].copy_(st[k])  # pre-fault the destination, as the slots are
        mem, libc = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for k in st:
                dst[k].copy_(st[k])
            mem.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for k in st:
                ctypes.memmove(dst[k].data_ptr(), st[k].data_ptr(), st[k].numel() * 4)
            libc.append(time.perf_counter() - t0)
        c.close()
    finally:
        stop_agent(agent)
        shutil.rmtree(shm, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"state {gb:.3f} GB, torch threads {torch.get_num_threads()}")
    print(f"first save (slot setup + copy): {first:.3f} s")
    print(f"save_async returned in {returned * 1e3:.2f} ms; copy done after {min(snap):.3f} s "
          f"({gb / min(snap):.2f} GB/s); agent checksum+commit {commit:.3f} s later (off the trainer path)")
    print(f"torch copy_ into pre-faulted memory: {min(mem):.3f} s ({gb / min(mem):.2f} GB/s)")
    print(f"glibc memcpy into pre-faulted memory: {min(libc):.3f} s ({gb / min(libc):.2f} GB/s)")
    fast = min(min(mem), min(libc))
    print(f"ratio snapshot_bandwidth_over_memcpy {fast / min(snap):.2f}")


if __name__ == "__main__":
    main()
