"""A campaign of random bit flips: the fraction caught and the steps to detection, against the coverage model.

Each run is a real `unbroken train` (--replicas 4, --steps 12, --microbatches 8, --exact, the default
tiny GPT, detect.state_every=--every) with one `flip` fault drawn at random (seeded): where (param,
optimizer, grad), which bit (exponent, mantissa, sign, or an index 0..31), which step (0..steps-3),
replica, tensor and element. From its event log: did the flip fire (its `flip` record), was it caught
(a `corruption` or `nonfinite` record naming that replica) and how many steps after the flip, and
does the run end on the failure-free trajectory (every step's digest the reference run's).

The coverage model (docs/corruption.md) predicts, per run, from the flip record alone:
  - a flip in the state (param, optimizer) changes the flipped group's digest: caught at the first state
    check at or after its step s, c(s) - s steps later (c(s): the next step with (c + 1) % every == 0),
    or sooner where its value made the next step's loss or gradient non-finite (the finite check);
  - a flip in a microbatch's gradient is reduced into every group alike and leaves no trace in the
    state's agreement: caught the same step where the microbatch is one `detect.recompute_fraction`
    (--recompute) draws (policy.corruption.recomputed: two more replicas compute it and outvote the
    owner), or where its value is non-finite (the finite check); otherwise missed.
`ratio flips_caught` is the fraction caught; `ratio flips_caught_predicted` the model's; `ratio
detection_steps_mean` and its predicted bound (for state flips) follow.

Usage: python benchmarks/flip_campaign.py [--runs 50] [--every 4] [--seed 0] [--recompute 0.25]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from unbroken.observe.runs import compare  # noqa: E402
from unbroken.policy.corruption import recomputed  # noqa: E402

STEPS, REPLICAS = 12, 4
BASE = ["--replicas", str(REPLICAS), "--steps", str(STEPS), "--microbatches", "8", "--exact",
        "--run.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
        "--parallel.device=cpu"]


def train(out: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *BASE, "--out", str(out), *extra],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"run {out} failed: {r.stderr[-800:]}")


def draw(rng: random.Random) -> str:
    where = rng.choice(["param", "optimizer", "grad"])
    bit = rng.choice(["exponent", "mantissa", "sign", str(rng.randrange(32))])
    spec = (f"flip:replica={rng.randrange(REPLICAS)},step={rng.randrange(STEPS - 2)},in={where},bit={bit},"
            f"tensor={rng.randrange(20)},element={rng.randrange(10_000)}")
    return spec + (f",microbatch={rng.randrange(8)}" if where == "grad" and rng.random() < 0.5 else "")


def next_check(step: int, every: int) -> int:
    return step + (every - 1 - step % every)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recompute", type=float, default=0.0, help="detect.recompute_fraction of the runs")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="flips-"))
    every = [f"--detect.state_every={args.every}", f"--detect.recompute_fraction={args.recompute}",
             "--run.quotas=equal"]
    train(tmp / "reference", *every)
    rows, failed = [], []
    for n in range(args.runs):
        spec = draw(rng)
        out = tmp / f"run{n}"
        try:
            train(out, *every, "--faults", spec)
        except RuntimeError as e:  # every replica lost (a NaN that each recomputation reproduced)
            print(f"{n:3d} {spec:80s} run failed: {str(e)[-200:]!r}", flush=True)
            failed.append(spec)
            continue
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        flips = [e for e in events if e["event"] == "flip"]
        if not flips:  # a grad flip in a microbatch its replica did not compute that step
            rows.append((spec, None, None, None, None, None))
            continue
        f = flips[0]
        found = [e for e in events if (e["event"] == "corruption" and (  # the device named: by a state
            (e.get("replica") == f["replica"] and "found" in e) or f["replica"] in e.get("wrong", ())))  # check, a vote
            or (e["event"] == "nonfinite" and e.get("replica") == f["replica"])]
        caught_at = min((e["step"] for e in found), default=None)
        finite = math.isfinite(float(f["after"]))
        drawn = f["target"] == "grad" and f["microbatch"] in recomputed(f["step"], 8, args.recompute)
        predicted = f["target"] != "grad" or not finite or drawn
        bound = next_check(f["step"], args.every) if f["target"] != "grad" else f["step"]
        cmp = compare(tmp / "reference", out)
        rows.append((spec, f["target"], caught_at is not None, predicted,
                     None if caught_at is None else caught_at - f["step"], cmp.identical == cmp.total))
        if f["target"] != "grad" and caught_at is not None:
            rows[-1] = rows[-1] + (bound - f["step"],)
        print(f"{n:3d} {spec:80s} caught={rows[-1][2]} predicted={predicted} "
              f"steps={rows[-1][4]} exact={rows[-1][5]}", flush=True)
    fired = [r for r in rows if r[1] is not None]
    caught = sum(r[2] for r in fired) / len(fired)
    predicted = sum(r[3] for r in fired) / len(fired)
    agree = sum(r[2] == r[3] for r in fired) / len(fired)
    delays = [r[4] for r in fired if r[4] is not None]
    bounds = [r[6] for r in fired if len(r) > 6]
    state = [r for r in fired if r[1] != "grad"]
    print(f"{len(rows) + len(failed)} runs, {len(failed)} failed, {len(fired)} flips fired ({len(state)} in state, {len(fired) - len(state)} in a "
          f"gradient); state_every={args.every}, recompute_fraction={args.recompute}")
    print(f"caught {caught:.3f}, predicted {predicted:.3f}, run by run the model right in {agree:.3f}")
    print(f"state flips caught {sum(r[2] for r in state)}/{len(state)}; gradient flips caught "
          f"{sum(r[2] for r in fired if r[1] == 'grad')}/{len(fired) - len(state)}")
    print(f"runs ending on the failure-free trajectory: {sum(bool(r[5]) for r in fired)}/{len(fired)}")
    print(f"ratio flips_caught {caught:.3f}")
    print(f"ratio flips_caught_predicted {predicted:.3f}")
    if delays:
        print(f"ratio detection_steps_mean {sum(delays) / len(delays):.2f}")
    if bounds:
        print(f"ratio detection_steps_bound_mean {sum(bounds) / len(bounds):.2f}  (state flips: the model's c(s) - s)")


if __name__ == "__main__":
    main()
