"""Restore from the snapshot agent vs torch.load and DCP load of the same state from disk.

All three land the state in the trainer's existing tensors: SnapshotClient.restore(out=...) (reads
the agent's /dev/shm slot, verifies every checksum and the whole-state digest, copies), torch.load
+ copy_, and DCP load (in place). The files were just written, so the disk readers are served from
the page cache: this is a WARM-cache comparison, the most favourable case for the disk readers. A
cold-disk figure needs dropping the page cache, which this benchmark does not do (shared machine).
Usage: python benchmarks/restore.py [--size-gb 1.2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import TCPStore

from unbroken.runtime.snapshot import AgentSpec, SnapshotClient, Topology, start_agent, stop_agent


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.2)
    p.add_argument("--quick", action="store_true", help="64 MB state")
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    n = int((0.064 if a.quick else a.size_gb) * 1e9) // 12
    st = {k: torch.rand(n) for k in ("param", "exp_avg", "exp_avg_sq")}
    gb = 12 * n / 1e9
    out = {k: torch.zeros_like(v) for k, v in st.items()}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=120))
    shm, run = Path("/dev/shm") / f"unbroken-bench-{uuid.uuid4().hex[:8]}", "bench"
    disk = Path(tempfile.mkdtemp(prefix="unbroken-restore-", dir="/tmp"))
    agent = start_agent(AgentSpec(f"127.0.0.1:{store.port}", run, 0, Topology(1, 1, "none"),
                                  str(shm)), store=store)
    try:
        c = SnapshotClient(store, run_id=run, rank=0, world=1, shm_dir=str(shm), timeout_s=120)
        c.save(1, st, {"step": 1})
        c.wait_committed(1, timeout_s=120)
        torch.save(st, disk / "state.pt")
        dcp.save(st, checkpoint_id=str(disk / "dcp"), no_dist=True)

        def torch_load():
            loaded = torch.load(disk / "state.pt")
            for k in out:
                out[k].copy_(loaded[k])

        t_snap = best(lambda: c.restore(out=out), a.reps)
        assert all(torch.equal(out[k], st[k]) for k in st)
        t_torch = best(torch_load, a.reps)
        t_dcp = best(lambda: dcp.load(out, checkpoint_id=str(disk / "dcp"), no_dist=True), a.reps)
        c.close()
    finally:
        stop_agent(agent)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(f"state {gb:.3f} GB into existing tensors, best of {a.reps}; disk files in the page cache (warm)")
    print(f"snapshot restore (checksums verified): {t_snap:.3f} s ({gb / t_snap:.2f} GB/s)")
    print(f"torch.load + copy_ (warm cache):      {t_torch:.3f} s ({gb / t_torch:.2f} GB/s)")
    print(f"DCP load (warm cache):                {t_dcp:.3f} s ({gb / t_dcp:.2f} GB/s)")
    print(f"ratio restore_speedup_vs_dcp_load_warm {t_dcp / t_snap:.2f}")
    print(f"ratio restore_speedup_vs_torch_load_warm {t_torch / t_snap:.2f}")


if __name__ == "__main__":
    main()
