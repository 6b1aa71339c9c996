"""Failure-free step time with coordination state in etcd over the embedded TCPStore (issue 26).

What it measures: what moving the store from the coordinator's TCPStore to a 3-member etcd cluster
(`--coord.store=etcd://...`, store/etcd.py: one HTTP request through etcd's JSON gateway per store call,
a Raft commit per write) costs a failure-free step: the step's store traffic (publishing `done`, the
compare-and-set of the decision and waiting for it, the step record, heartbeats meanwhile) goes to etcd.

How: real runs through unbroken's own launcher, the same config (2 replicas, one trainer process each,
the default 0.1M-parameter GPT), alternated TCP etcd etcd TCP ... so drift in the machine's load falls on
both alike; the etcd cluster is three real `etcd` processes on loopback ports (tests/etcd_cluster.py),
with its data on this machine's disk. Step time = the time between replica 0's `applied` records of
steps s-1 and s (the whole step, coordination included); steady state: the first --skip steps of every
run are dropped. Per mode: the median step time of each run; the ratio is the best (lowest) run of
etcd over the best run of TCP (interference on a shared machine only adds time).

What the ratio leaves out, and what it includes that a cluster would not: here the three etcd members
run on the same 2 cores as the trainers, so their CPU (printed: CPU seconds per step, all members) is
taken from training; on a cluster etcd runs on hosts of its own, and its latency is a network round
trip plus a disk fsync per write on each member (loopback and this disk here). Start-up (etcd, torch
imports) and recoveries are not in it.
Usage: python benchmarks/store_overhead.py [--rounds 2] [--steps 40] [--replicas 2] [--skip 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/etcd_cluster.py

from tests.etcd_cluster import start  # noqa: E402
from unbroken.api import make_config  # noqa: E402
from unbroken.events import read_events  # noqa: E402
from unbroken.runtime.launcher.launch import launch  # noqa: E402


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes so far (/proc/PID/stat, clock ticks of 1/100 s)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / 100.0


def step_times(out: Path, skip: int) -> list[float]:
    applied = {e["step"]: e["t"] for e in read_events(out) if e["event"] == "applied" and e["replica"] == 0}
    return [applied[s] - applied[s - 1] for s in sorted(applied) if s > skip and s - 1 in applied]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--skip", type=int, default=5)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-overhead-"))
    cluster = start(root / "etcd", 3)
    pids = [p.pid for p in cluster.procs]
    print(f"config: {a.replicas} replicas, {a.steps} steps, 4 microbatches, default model; "
          f"etcd 3 members on loopback ({cluster.url}); {a.rounds} rounds, TCP and etcd alternated")
    medians: dict[str, list[float]] = {"tcp": [], "etcd": []}
    etcd_cpu: list[float] = []
    try:
        for r in range(a.rounds):
            for mode in (("tcp", "etcd") if r % 2 == 0 else ("etcd", "tcp")):
                store = f"{cluster.url}/bench-{uuid.uuid4().hex[:8]}" if mode == "etcd" else ""
                cfg = make_config(None, replicas=a.replicas, steps=a.steps, microbatches=4, launch__progress=False,
                                  launch__out=str(root / f"{mode}{r}"), coord__store=store)
                before = cpu_seconds(pids)
                result = launch(cfg, title=mode)
                if not result.ok:
                    raise SystemExit(f"{mode} run failed: {result.error}")
                times = step_times(root / f"{mode}{r}", a.skip)
                medians[mode].append(statistics.median(times))
                if mode == "etcd":
                    etcd_cpu.append((cpu_seconds(pids) - before) / a.steps)
                print(f"round {r} {mode:4s}: median step {1e3 * medians[mode][-1]:7.2f} ms  "
                      f"(p10 {1e3 * sorted(times)[len(times) // 10]:.2f}, p90 {1e3 * sorted(times)[9 * len(times) // 10]:.2f}, "
                      f"{len(times)} steps)" + (f"  etcd CPU {1e3 * etcd_cpu[-1]:.1f} ms/step" if mode == "etcd" else ""))
    finally:
        cluster.stop()
    best = {m: min(v) for m, v in medians.items()}
    print(f"best run: tcp {1e3 * best['tcp']:.2f} ms/step, etcd {1e3 * best['etcd']:.2f} ms/step; "
          f"etcd members' CPU per step (same 2 cores as the trainers) {1e3 * min(etcd_cpu):.1f} ms")
    print("leaves out: start-up, recoveries; includes etcd's CPU on the trainers' cores (not so on a cluster)")
    print(f"ratio etcd_over_tcp {best['etcd'] / best['tcp']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
