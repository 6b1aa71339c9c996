"""The simulator, calibrated on one real run, predicts another real run's faults on the wall clock.

Owns: the wall-clock figures that tests/sim/test_calibration.py prints but does not assert for the kill,
because they rest on a premise a shared host breaks: the survivor of a kill computes at the speed it had
beside its peer (each replica pinned to a core, `--run.pin_cores`). Run it alone on a quiet host.

Per round: a calibration run (2 replicas, 10 steps, the named fault at step 4) and a target run (18 steps,
a kill at step 8 in the allreduce phase; or a 3x slow replica from step 5), then
sim/calibrate.predict_other. Prints each round's predicted and measured seconds from the step before the
first fault to the last commit, and `ratio kill_prediction` / `ratio slow_prediction`: the median of
predicted over measured. What it leaves out: start-up (not simulated), and the premise itself, which it
measures and prints (the survivor's microbatch time after the kill over before, median) so a round on a
host whose speed moved is seen as such.

    python benchmarks/calibration.py --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from unbroken.events import read_events
from unbroken.sim.calibrate import predict_other

COMMON = ["--replicas", "2", "--microbatches", "8", "--data.batch_size=16", "--run.progress=false", "--run.pin_cores=true",
          "--run.quotas=equal", "--coord.heartbeat_timeout=1.0", "--coord.heartbeat_interval=0.1"]
CASES = {"kill": (("kill:replica=1,step=4,phase=compute", 10), ("kill:replica=0,step=8,phase=allreduce", 18)),
         "slow": (("slow:replica=0,from=5,to=8,factor=2,how=throttle", 10), ("slow:replica=1,from=5,factor=3,how=throttle", 14))}


def train(out: Path, steps: int, faults: str) -> None:
    subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *COMMON, "--steps", str(steps), "--faults",
                    faults, "--out", str(out)], check=True, timeout=300, stdout=subprocess.DEVNULL)


def premise(target: Path) -> float:
    """The survivor's (replica 1's) median microbatch wall time after the kill over before it."""
    events = read_events(target)
    own: dict[bool, list[float]] = {False: [], True: []}
    for e in events:
        if e["event"] == "compute" and e["replica"] == 1 and e["step"] >= 1 and e["step"] != 8:
            own[e["step"] > 8].append(e.get("wall", e["seconds"]))
    return statistics.median(own[True]) / statistics.median(own[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="kill,slow")
    args = ap.parse_args()
    for case in args.cases.split(","):
        (cal_faults, cal_steps), (target_faults, target_steps) = CASES[case]
        ratios = []
        for k in range(args.rounds):
            with tempfile.TemporaryDirectory() as d:
                train(Path(d) / "cal", cal_steps, cal_faults)
                train(Path(d) / "target", target_steps, target_faults)
                p = predict_other(Path(d) / "cal", Path(d) / "target")
                extra = f", survivor's speed after/before {premise(Path(d) / 'target'):.2f}" if case == "kill" else ""
                print(f"{case} round {k}: predicted {p.predicted_wall:.2f} s, measured {p.measured_wall:.2f} s "
                      f"({p.wall_error:.1%} off){extra}", flush=True)
                ratios.append(p.predicted_wall / p.measured_wall)
        print(f"ratio {case}_prediction {statistics.median(ratios):.3f} (predicted over measured wall seconds, median "
              f"of {args.rounds}; lowest {min(ratios):.3f}, highest {max(ratios):.3f})")


if __name__ == "__main__":
    main()
