"""Restore from the snapshot agent vs torch.load and DCP load of the same state from disk.

All three land the state in the trainer's existing tensors: SnapshotClient.restore(out=...) (reads
the agent's /dev/shm slot, verifies every XXH3 checksum and the whole-state digest, copies),
torch.load + copy_, and DCP load (in place).

Two disk figures, both printed:
- COLD (the headline): before every disk load, each checkpoint file is fsync'ed and dropped from
  the page cache with posix_fadvise(DONTNEED) (per file; no root-wide cache drop), and mincore()
  confirms that (almost) none of its pages are resident. This is what a restart pays to reload a
  checkpoint from persistent storage. (On a VM the host may still cache the virtual disk; the read
  rate printed says how cold the reads really were.)
- WARM: the files were just read, so the disk readers are served from the page cache: the most
  favourable case for them.
Snapshot restore is timed in a fresh client each time (it maps the slot file, as a restarted
trainer does), paired with the cold loads, and in one client that keeps its mappings between
restores, paired with the warm loads. Best of --reps for every figure.
Usage: python benchmarks/restore.py [--size-gb 1.2] [--quick] [--reps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import mmap
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import TCPStore

from unbroken.runtime.snapshot import AgentSpec, SnapshotClient, Topology, start_agent, stop_agent

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def evict(path: Path) -> None:
    """Drop every file under `path` from the page cache: fsync (dirty pages cannot be dropped),
    then posix_fadvise(DONTNEED) over the whole file."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(path: Path) -> tuple[int, int]:
    """(resident, total) bytes of the files under `path` in the page cache, by mincore()."""
    page = mmap.PAGESIZE
    have = total = 0
    for f in files_under(path):
        size = f.stat().st_size
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            try:
                npages = -(-size // page)
                vec = ctypes.create_string_buffer(npages)
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {f}")
                pages = sum(b & 1 for b in vec.raw)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        have += min(pages * page, size)
        total += size
    return have, total


def best(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before:
            before()
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
    disk = Path(tempfile.mkdtemp(prefix="unbroken-restore-", dir="/var/tmp"))
    pt, dc = disk / "state.pt", disk / "dcp"
    agent = start_agent(AgentSpec(f"127.0.0.1:{store.port}", run, 0, Topology(1, 1, "none"),
                                  str(shm)), store=store)
    residency: list[float] = []

    def client() -> SnapshotClient:
        return SnapshotClient(store, run_id=run, rank=0, world=1, shm_dir=str(shm), timeout_s=120)

    def clear_out() -> None:
        for t in out.values():
            t.zero_()

    def check_out() -> None:
        assert all(torch.equal(out[k], st[k]) for k in st), "restored state differs"

    def cold(path: Path):
        def prep() -> None:
            clear_out()
            evict(path)
            have, total = resident(path)
            residency.append(have / total)
        return prep

    def torch_load() -> None:
        loaded = torch.load(pt)
        for k in out:
            out[k].copy_(loaded[k])

    def dcp_load() -> None:
        dcp.load(out, checkpoint_id=str(dc), no_dist=True)

    fresh: list[SnapshotClient] = []

    def fresh_restore() -> None:  # a new client's first restore; it is closed outside the timing
        fresh.append(client())
        fresh[-1].restore(out=out)

    def close_fresh() -> None:
        while fresh:
            fresh.pop().close()
        clear_out()

    try:
        writer = client()
        writer.save(1, st, {"step": 1})
        writer.wait_committed(1, timeout_s=120)
        writer.close()
        torch.save(st, pt)
        dcp.save(st, checkpoint_id=str(dc), no_dist=True)

        # Snapshot restore, fresh client each time (maps the slot, as a restarted trainer does).
        t_fresh = best(fresh_restore, a.reps, close_fresh)
        check_out()
        close_fresh()
        # Snapshot restore, one client keeping its mappings between restores.
        keep = client()
        keep.restore(out=out)
        t_keep = best(lambda: keep.restore(out=out), a.reps, clear_out)
        check_out()
        keep.close()

        # Cold: every file evicted from the page cache (and checked by mincore) before each load.
        t_torch_cold = best(torch_load, a.reps, cold(pt))
        check_out()
        t_dcp_cold = best(dcp_load, a.reps, cold(dc))
        check_out()
        # Warm: the files were just read; read them once more, then time.
        torch_load()
        t_torch_warm = best(torch_load, a.reps, clear_out)
        check_out()
        dcp_load()
        t_dcp_warm = best(dcp_load, a.reps, clear_out)
        check_out()
        warm_have, warm_total = resident(disk)
    finally:
        stop_agent(agent)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    def row(label: str, t: float) -> None:
        print(f"{label:60s} {t:.3f} s ({gb / t:5.2f} GB/s)")

    print(f"state {gb:.3f} GB into existing tensors, best of {a.reps}, torch threads "
          f"{torch.get_num_threads()}; disk files in {disk.parent}")
    print(f"page cache before each cold load (mincore): at most {max(residency):.2%} of the files "
          f"resident; after the warm loads: {warm_have / warm_total:.2%}")
    row("snapshot restore, fresh client (maps slot; checksums verified)", t_fresh)
    row("snapshot restore, mappings kept (checksums verified)", t_keep)
    row("torch.load + copy_, COLD (evicted from page cache)", t_torch_cold)
    row("DCP load, COLD (evicted from page cache)", t_dcp_cold)
    row("torch.load + copy_, warm (page cache)", t_torch_warm)
    row("DCP load, warm (page cache)", t_dcp_warm)
    print("warm: disk loads from the page cache vs restore with mappings kept; cold: disk loads "
          "after eviction vs restore in a fresh client")
    print(f"ratio restore_speedup_vs_torch_load_warm {t_torch_warm / t_keep:.2f}")
    print(f"ratio restore_speedup_vs_dcp_load_warm {t_dcp_warm / t_keep:.2f}")
    print(f"ratio restore_speedup_vs_torch_load_cold {t_torch_cold / t_fresh:.2f}")
    print(f"ratio restore_speedup_vs_dcp_load_cold {t_dcp_cold / t_fresh:.2f}")
    print(f"ratio restore {min(t_torch_cold, t_dcp_cold) / t_fresh:.2f}")


if __name__ == "__main__":
    main()
