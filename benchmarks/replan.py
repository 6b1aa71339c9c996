"""Committed throughput after a rank is lost for good: a pipeline (or FSDP2) group shrunk onto its survivor
against the group dropped.

Owns: running 2 groups x PP 2 (`--layout hsdp`: 2 groups x 2 FSDP2 shards, each rank its rows of every
microbatch; `--layout pp-fsdp`: 2 groups x 2 stages x 2 FSDP2 shards) through unbroken's own launcher
(gloo, --exact), the last rank (the last stage, or shard 1; stage 1's shard 1) of group 1 SIGKILLed at
step FROM and never replaced, under `--parallel.on_rank_loss=replan` (the coordinator's scheduler chooses;
here it chooses shrink: group 1 goes on as its survivor running the whole model, or with pp-fsdp as a
pipeline of two survivors, one a stage, each holding both shards of its stage: runtime/trainer/replan_reform.py;
healed from group 0, its quota weight the cost model's) and `--parallel.on_rank_loss=drop` (group 1 leaves for the
rest of the run: torchrun stops its survivor, and nothing restarts it), alternating the two in every round,
and reading each run's committed tokens per second over the episode from its event log.

Episode: from the commit of step FROM - 1 (the last step before the loss) to the commit of the last step,
so the loss, the redo of the lost group's microbatches and the shrink's re-form and heal all count.

Two figures, both printed. Device time (the headline, `ratio shrink_over_drop`): per step the busiest
group's device seconds (compute events: a pipeline group's slowest stage, a shrunk group's own thread CPU
time), i.e. the step's compute critical path when every rank has a device of its own, as on a cluster.
Wall clock (`ratio shrink_over_drop_wall`): on this 2-core host the ranks share the cores, so after the
loss drop runs 2 processes on 2 cores and shrink 3 on the same 2: the survivor's "idle GPU" that shrink puts
back to work is not idle capacity here, and the wall-clock ratio cannot show what the device-time one does.
What both leave out: the all-reduce, commit and optimizer step (in the wall clock only); a replaced rank
growing the group back (the lost rank never returns here; tests/runtime/trainer/test_shrink.py grows groups back).
Usage: python benchmarks/replan.py [--rounds 1] [--steps 24] [--microbatches 12] [--layout pp|hsdp|pp-fsdp]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _alternate.py, from anywhere
from _alternate import add_pipeline_args, alternate, pipeline_base  # noqa: E402

FROM = 3  # the step rank 1 of group 1 is killed in


def measure(records: list[dict]) -> dict:
    """Committed tokens per wall-clock second and per device-time critical-path second over the episode, and
    per device-time second over the steady state: the steps after the shrunk group's heal (`steady_from`,
    the first of them; a drop run has none of its own: main() takes the shrink run's)."""
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    last = max(steps)
    # (step, group, rank) -> device s, from its compute events (each rank logs its own, a stand-in for all it
    # holds; a step's critical path is its busiest rank's)
    busy: dict[tuple[int, int, int], float] = {}
    for r in records:
        if r["event"] == "compute" and r["step"] >= FROM:
            key = (r["step"], r["replica"], r.get("rank", 0))
            busy[key] = busy.get(key, 0.0) + r["seconds"]
    path = {step: max(v for (s, _, _), v in busy.items() if s == step) for step in range(FROM, last + 1)}
    tokens = {step: steps[step]["tokens"] for step in path}
    plans = [r for r in records if r["event"] == "group_plan" and r.get("why") == "rank lost"]
    heals = [r["step"] for r in records if r["event"] == "heal" and r.get("shrunk")]
    return {"wall": sum(tokens.values()) / (steps[last]["t"] - steps[FROM - 1]["t"]),
            "device": sum(tokens.values()) / sum(path.values()), "path": path, "tokens": tokens,
            "steady_from": max(heals) + 1 if heals else None,
            "measured": next((r for r in records if r["event"] == "group_plan_measured" and r["applied"] == "shrink"),
                             None),
            "applied": plans[0]["applied"] if plans else "none (drop)",
            "weight": plans[0]["applied_weight"] if plans else 0.0,
            "last_quotas": "/".join(f"{g}:{len(v)}" for g, v in sorted(steps[last]["owners"].items()))}


def against(e: dict | None) -> str:
    """The coordinator's `group_plan_measured` figures beside their predictions, for a round's line."""
    if e is None:
        return ""
    return (f"; shrink measured against predicted: re-plan {e['measured_replan_seconds']} s vs "
            f"{e['predicted_replan_seconds']} s, moved {e['moved_bytes']} B vs {e['predicted_moved_bytes']} B, "
            f"weight {e['measured_weight']} vs {e['predicted_weight']}")


def steady(m: dict, first: int) -> float:
    """Committed tokens per device-time critical-path second over steps `first`.. of one run."""
    window = [s for s in m["path"] if s >= first]
    return sum(m["tokens"][s] for s in window) / sum(m["path"][s] for s in window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="alternations of shrink (replan) / drop")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--layout", choices=("pp", "hsdp", "pp-fsdp"), default="pp", help="what a group splits: "
                    "the layers (2 pipeline stages), every microbatch's rows (2 FSDP2 shards) or both (4 ranks)")
    add_pipeline_args(ap)
    args = ap.parse_args()
    t0 = time.time()
    ranks = 4 if args.layout == "pp-fsdp" else 2
    base = pipeline_base(args, f"kill:replica=1,rank={ranks - 1},step={FROM},phase=compute",
                         coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1)
    base["parallel__group_size"] = ranks
    if args.layout == "hsdp":
        base["parallel__pp"] = 1
    # reform 0.5 s: this host's order of magnitude for a shrink (rebuild + heal, ~0.1-0.3 s measured), not
    # the cost model's H100 default of 2 s, which over 20 steps of ~0.3 s would price shrink out
    modes = {"shrink": dict(parallel__on_rank_loss="replan", hardware__reform_seconds=0.5),
             "drop": dict(parallel__on_rank_loss="drop")}
    got = alternate(args.rounds, modes, base, "replan", measure, lambda rnd, mode, m: (
        f"round {rnd + 1} {mode:>6}: applied {m['applied']} (weight {m['weight']}), last quotas "
        f"{m['last_quotas']}; {m['wall']:.0f} committed tokens/s wall clock, {m['device']:.0f} per "
        f"device-time critical-path second{against(m['measured'])}"))
    wall = {m: statistics.median(r["wall"] for r in got[m]) for m in modes}
    device = {m: statistics.median(r["device"] for r in got[m]) for m in modes}
    shape = {"pp": "PP 2", "hsdp": "2 FSDP2 shards", "pp-fsdp": "PP 2 x 2 FSDP2 shards"}[args.layout]
    print(f"2 groups x {shape}, group 1's rank {ranks - 1} killed at step {FROM} and never replaced, M={args.microbatches}, "
          f"{args.rounds} rounds x {args.steps} steps, episode = steps {FROM}..{args.steps - 1} (the loss, redo, "
          f"re-form and heal included); wall {time.time() - t0:.0f} s")
    print(f"committed tokens/s (median over rounds): device-time critical path shrink {device['shrink']:.0f}, "
          f"drop {device['drop']:.0f}; wall clock shrink {wall['shrink']:.0f}, drop {wall['drop']:.0f} (2 cores "
          f"shared by every rank: see the docstring)")
    first = max(r["steady_from"] for r in got["shrink"])
    calm = {m: statistics.median(steady(r, first) for r in got[m]) for m in modes}
    print(f"steady state (steps {first}..{args.steps - 1}, after the shrunk group's heal): device-time critical "
          f"path shrink {calm['shrink']:.0f}, drop {calm['drop']:.0f}, ratio {calm['shrink'] / calm['drop']:.3f} "
          f"(1.5, 3 of 4 busy ranks' worth, would need the shrunk group's microbatch to cost exactly two of "
          f"the full group's and M to split 2:1)")
    print(f"ratio shrink_over_drop_wall {wall['shrink'] / wall['drop']:.3f}")
    print(f"ratio shrink_over_drop {device['shrink'] / device['drop']:.3f}")


if __name__ == "__main__":
    main()
