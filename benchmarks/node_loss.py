"""Node loss with replica groups under restart-memory: how many runs rebuild the node from parity and
end on the failure-free trajectory.

The scenario of issue 64, as a user would run it: 3 groups x 2 ranks (FSDP2 inside), 8 steps, in-memory
snapshots every step with XOR parity across 3 nodes (k=2, m=1), `--run.recovery=restart-memory`, and
node 1 (group 1's two ranks, its agent, its memory) lost as step 4 begins, nothing holding the
survivors. Then the same with the node lost inside a parity encode (`node:node=1,step=2,phase=parity`:
its agent of shard index 1 stops inside its encode of step 2's snapshot while shard index 0's encodes
and seals it; the node is lost two steps later). One failure-free reference run first; every run is a
real `unbroken train` of its own, one at a time.

A run counts as good when its log has `rebuilt` (node 1, from parity), every rank `restored` from
memory at that step, and every step record (each copy of a redone step included) carries the
reference's digest. Printed: the counts of each scenario and what the others did (`rebuild_failed`
with its error, another restore source, a digest off the trajectory).

Last line: `ratio node_loss_rebuilt_on_trajectory VALUE` (good runs over all runs). What it leaves out:
time (each run's wall clock is printed, not compared) and loads other than this host's own.
Usage: python benchmarks/node_loss.py [--runs 10] [--encode-runs 3] [--steps 8] [--fault-step 4]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unbroken.events import read_events, step_copies, steps

BASE = ["--replicas", "3", "--parallel.group_size=2", "--microbatches", "6", "--exact", "--model.dropout=0",
        "--run.progress=false", "--coord.heartbeat_timeout=5.0", "--coord.heartbeat_interval=0.1"]
SNAPSHOTS = ["--snapshot.enabled=true", "--snapshot.nodes=3", "--snapshot.parity=xor", "--snapshot.k=2",
             "--snapshot.m=1", "--run.recovery=restart-memory"]


def train(out: Path, n_steps: int, *extra: str) -> float:
    """One `unbroken train` run into `out`; returns its wall seconds. Raises SystemExit if it fails."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *BASE, "--steps", str(n_steps), *extra,
                        "--out", str(out)], capture_output=True, text=True, env=os.environ.copy())
    if r.returncode != 0:
        raise SystemExit(f"run {out} failed: {r.stderr[-1500:]}")
    return time.monotonic() - t0


def verdict(run: Path, want: dict[int, str]) -> tuple[bool, str]:
    """(good, what the run did): rebuilt from parity, restored from memory, every step on the trajectory."""
    events = read_events(run)
    mended = [e for e in events if e["event"] in ("rebuilt", "rebuild_failed")]
    restored = [e for e in events if e["event"] == "restored"]
    off = sorted(s for s, rs in step_copies(events).items() for r in rs if r["param_digest"] != want.get(s))
    fault = next(e for e in events if e["event"] == "fault")
    where = f"fault after step {max((e['step'] for e in events[:events.index(fault)] if e['event'] == 'step'), default=-1)}"
    if len(mended) != 1 or mended[0]["event"] != "rebuilt":
        return False, f"{where}; " + "; ".join(f"{e['event']} {e.get('error', '')}" for e in mended) or "no rebuild"
    step = mended[0]["step"]
    good = (mended[0]["nodes"] == [1] and len(restored) == 6 and not off
            and all(e["source"] == "memory" and e["step"] == step for e in restored) and sorted(steps(events)) == sorted(want))
    return good, (f"{where}; rebuilt at step {step}; restored from {sorted({e['source'] for e in restored})} "
                  f"at {sorted({e['step'] for e in restored})}; steps off the trajectory {off}")


def scenario(name: str, root: Path, runs: int, n_steps: int, faults: str, want: dict[int, str]) -> int:
    good = 0
    for i in range(runs):
        out = root / f"{name}{i}"
        seconds = train(out, n_steps, *SNAPSHOTS, "--faults", faults)
        ok, what = verdict(out, want)
        good += ok
        print(f"{name} run {i}: {'good' if ok else 'BAD '} ({seconds:.1f} s) {what}", flush=True)
    print(f"{name}: {good} of {runs} runs rebuilt node 1 from parity and ended on the failure-free trajectory "
          f"(--faults \"{faults}\")", flush=True)
    return good


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs with the node lost as --fault-step begins")
    ap.add_argument("--encode-runs", type=int, default=3, help="runs with the node lost inside a parity encode")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault-step", type=int, default=4)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="node-loss-"))
    train(root / "ref", args.steps)
    want = {s: r["param_digest"] for s, r in steps(read_events(root / "ref")).items()}
    print(f"3 groups x 2 ranks, {args.steps} steps, XOR 2+1 across 3 nodes, restart-memory; runs in {root}")
    good = scenario("mid-run", root, args.runs, args.steps, f"node:node=1,step={args.fault_step}", want)
    good += scenario("in-encode", root, args.encode_runs, args.steps, "node:node=1,step=2,phase=parity", want)
    print(f"ratio node_loss_rebuilt_on_trajectory {good / (args.runs + args.encode_runs):.3f}")


if __name__ == "__main__":
    main()
