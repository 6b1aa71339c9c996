"""Throughput over a fail-slow episode inside a pipeline group: the scheduler's choice beside "drop" and "do nothing".

Owns: running 2 groups x PP 2 through unbroken's own launcher (one real torchrun job per group, gloo),
rank 1 (the last stage) of group 1 spinning `--factor` x its compute from step 2 to the end, under
--run.quotas=speed (the coordinator calls policy.scheduling.decide when the detector declares the group
Slow and applies what the runtime can execute: reweight; and, with each rank its own torchrun agent under
--parallel.on_rank_loss=replan, shrink around the located slow rank onto one healthy rank running the whole
model, "shrink" below), --run.quotas=drop (ResiHP's baseline: the
group declared Slow is parked, quota 0, for the rest of the run) and --run.quotas=equal (the decision is
logged, keep is applied: "do nothing"), alternating the four in every round, and reading each run's
committed tokens per second over the episode from its event log.

Episode: from the commit of step 1 (the last step before the slowdown) to the commit of the last step;
committed tokens are the step records' tokens over those steps. The transient counts in full: the steps
before the detector declares the group Slow and before its quotas change run with equal quotas in both
configurations. Step 0 and 1 are left out (process start, and the healthy steps the predictor learns from).

Two figures, printed side by side: device time and wall clock. Device time: per step the busiest
group's device seconds, each of its microbatches at its slowest rank's (every pipeline stage logs its own
`compute` time, so all the group's ranks are read, not rank 0's alone), the critical path of the step's
compute blind to waiting for one of this machine's cores. What both leave out:
the all-reduce, commit and optimizer step are in the wall-clock figure but not the device-time one;
neither includes what repartition (not executable here) would give; under "shrink" the episode includes
the eviction, the survivor's rebuild and heal (the group out of the step meanwhile); a parked group still joins
every step's all-reduce (a zero share), which a group taken out of the run would not; on this 2-core host
shared with other jobs the wall-clock ratio is noisy (each round's value is printed, so the spread shows),
and a spinning slow rank burns a core that the healthy group could use, so here "drop" (the spin stops
with the group's work) wins wall clock for a reason a GPU node does not have (its spin would be on its
own device): the device-time ratios are the ones that carry over.
Usage: python benchmarks/slow_pp.py [--rounds 2] [--steps 30] [--microbatches 8] [--factor 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _alternate.py, from anywhere
from _alternate import add_pipeline_args, alternate, pipeline_base  # noqa: E402

FROM = 2  # the step the slowdown starts


def critical_path(records: list[dict], steps: range) -> float:
    """Device seconds of the steps' critical path: each microbatch at its group's slowest rank (each
    pipeline stage logs its own time, events.py `compute`; a stage waiting on a slow peer spends none),
    summed over the group's microbatches, the busiest group's a step. A rank's redone microbatches (a
    retried step) add to its time."""
    own: dict[tuple[int, int, int, int], float] = {}  # (step, group, microbatch, rank) -> device s
    for r in records:
        if r["event"] == "compute" and r["step"] in steps:
            k = (r["step"], r["replica"], r["microbatch"], r.get("rank", 0))
            own[k] = own.get(k, 0.0) + r["seconds"]
    slowest: dict[tuple[int, int, int], float] = {}  # (step, group, microbatch) -> its slowest rank's s
    for (s, g, i, _), v in own.items():
        slowest[s, g, i] = max(slowest.get((s, g, i), 0.0), v)
    group: dict[tuple[int, int], float] = {}  # (step, group) -> device s
    for (s, g, _), v in slowest.items():
        group[s, g] = group.get((s, g), 0.0) + v
    return sum(max(v for (s, _), v in group.items() if s == step) for step in steps)


def measure(records: list[dict]) -> dict[str, float]:
    """Committed tokens per wall-clock second and per device-time critical-path second over the episode."""
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    last = max(steps)
    episode = range(FROM, last + 1)
    tokens = sum(steps[s]["tokens"] for s in episode)
    wall = steps[last]["t"] - steps[FROM - 1]["t"]
    path = critical_path(records, episode)
    plans = [r for r in records if r["event"] == "group_plan"]
    return {"wall": tokens / wall, "device": tokens / path, "applied": plans[0]["applied"] if plans else "none",
            "decision": plans[0]["decision"] if plans else "none", "at": plans[0]["step"] if plans else -1,
            "last_quotas": "/".join(str(len(v)) for _, v in sorted(steps[last]["owners"].items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternations of reweight (speed) / drop / equal")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--factor", type=float, default=3.0, help="slowdown of group 1's rank 1, from step 2")
    add_pipeline_args(ap)
    args = ap.parse_args()
    t0 = time.time()
    base = pipeline_base(args, f"slow:replica=1,rank=1,from={FROM},factor={args.factor:g},how=throttle")
    # shrink: the same speed quotas where the group may shrink around its located slow rank (each rank its
    # own torchrun agent, parallel.on_rank_loss=replan); a re-form priced at what one costs here (~0.1 s)
    modes = {"reweight": {"quotas": "speed"}, "drop": {"quotas": "drop"}, "equal": {"quotas": "equal"},
             "shrink": {"quotas": "speed", "parallel__on_rank_loss": "replan", "hardware__reform_seconds": 0.1}}
    got = alternate(args.rounds, modes, base, "slow pp", measure, lambda rnd, mode, m: (
        f"round {rnd + 1} {mode:>8} (--run.quotas={modes[mode]['quotas']}"
        f"{', on_rank_loss=replan' if mode == 'shrink' else ''}): scheduler chose {m['decision']} at "
        f"step {m['at']}, applied {m['applied']}, last quotas {m['last_quotas']}; committed "
        f"tokens/s: device-time critical path {m['device']:.0f}, wall clock {m['wall']:.0f}"))
    wall = {m: statistics.median(r["wall"] for r in got[m]) for m in modes}
    device = {m: statistics.median(r["device"] for r in got[m]) for m in modes}
    print(f"2 groups x PP 2, group 1's last stage {args.factor:g}x slow from step {FROM}, M={args.microbatches}, "
          f"{args.rounds} rounds x {args.steps} steps, episode = steps {FROM}..{args.steps - 1}; wall {time.time() - t0:.0f} s")
    for a in ("reweight", "drop", "shrink"):
        print(f"per round, {a}/equal: " + ", ".join(
            f"device time {x['device'] / y['device']:.3f} wall clock {x['wall'] / y['wall']:.3f}"
            for x, y in zip(got[a], got["equal"])))
    print("committed tokens/s (median over rounds): " + "; ".join(
        f"{m} device-time critical path {device[m]:.0f}, wall clock {wall[m]:.0f}" for m in modes)
        + " (the critical path leaves out all-reduce, commit, optimizer and core contention)")
    for name, a, b in (("shrink_over_reweight", "shrink", "reweight"), ("reweight_over_drop", "reweight", "drop"),
                       ("reweight_over_equal", "reweight", "equal"), ("drop_over_equal", "drop", "equal")):
        print(f"ratio {name}: device time {device[a] / device[b]:.3f}, wall clock {wall[a] / wall[b]:.3f}")


if __name__ == "__main__":
    main()
