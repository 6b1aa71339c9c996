"""CPU seconds of unbroken's control plane against its trainers, failure-free, with replica groups.

One real run through the CLI: R groups of G ranks (each group a torchrun job), N steps, equal quotas. Every
0.2 s the script reads the CPU time (user + system, /proc/PID/stat) of every process under the launcher and
sorts them by kind: trainer ranks, torchrun agents, the coordinator, the launcher. The window runs from the
`--skip`th step record to the last one (start-up, imports and the first `fully_shard` left out), so the
figures are steady state.

Why CPU seconds and not a wall-clock ratio: on the 2-core development machine every process competes for
the same 2 cores, so whatever the control plane burns is taken from the trainers; its CPU share is the
floor under benchmarks/hsdp_overhead.py's ratio there. On a GPU node the control plane runs on host cores
the trainers do not compute on.

What it leaves out: the trainers' own control threads (heartbeat, sidecar, epoch and decision watches) and
their store round trips count as trainer CPU here: they are threads of the trainer processes.

Last line: `ratio control_plane_cpu_share V` (coordinator + launcher + torchrun agents over all CPU seconds
in the window). Usage: python benchmarks/control_plane_cpu.py [--replicas 2] [--group-size 2] [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unbroken.runtime.launcher.processes import process_tree

HZ = os.sysconf("SC_CLK_TCK")


def kind(cmdline: str) -> str:
    if "torch.distributed.run" in cmdline:
        return "torchrun agents"
    if "unbroken.runtime.trainer" in cmdline:
        return "trainer ranks"
    if "unbroken.runtime.coordinator.coordinator" in cmdline:
        return "coordinator"
    return "launcher" if "unbroken.cli" in cmdline else "other"


def sample(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds so far) for every live process under `root`."""
    out = {}
    for pid in process_tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile
        out[pid] = (kind(cmd), (int(fields[11]) + int(fields[12])) / HZ)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=20, help="step records before the window starts")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="control-plane-")) / "run"
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(args.replicas),
           f"--parallel.group_size={args.group_size}", "--steps", str(args.steps), "--microbatches", "4",
           "--run.quotas=equal", "--launch.progress=false", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
    while p.poll() is None:
        samples.append((time.time(), sample(p.pid)))
        time.sleep(0.2)
    if p.returncode:
        raise SystemExit(f"the run failed (exit {p.returncode}; run dir {out})")
    steps = sorted(json.loads(line)["t"] for line in (out / "events.jsonl").read_text().splitlines()
                   if json.loads(line)["event"] == "step")
    t0, t1 = steps[args.skip], steps[-1]
    first = next(s for t, s in samples if t >= t0)
    last = [s for t, s in samples if t <= t1][-1]
    used: dict[str, float] = {}
    for pid, (k, cpu) in last.items():
        used[k] = used.get(k, 0.0) + cpu - first.get(pid, (k, 0.0))[1]
    total = sum(used.values())
    print(f"{args.replicas} groups x {args.group_size} ranks on {len(os.sched_getaffinity(0))} cores, steps "
          f"{args.skip}..{len(steps) - 1} ({t1 - t0:.1f} s of wall time), CPU seconds by process kind:")
    for k, v in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"  {k:16s} {v:7.2f} s  {v / total:6.1%}")
    control = sum(v for k, v in used.items() if k in ("coordinator", "launcher", "torchrun agents"))
    print(f"ratio control_plane_cpu_share {control / total:.4f}")


if __name__ == "__main__":
    main()
