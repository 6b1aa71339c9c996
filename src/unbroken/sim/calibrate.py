"""Calibration against reality: a scenario built from a real run's events.jsonl, the simulator's
prediction of that same run's wall time and committed tokens, and (predict_other) of another run with
other faults from the first one's costs.

Owns: reading costs off a real log (step boundaries from the reductions that counted (`boundaries`),
per-microbatch time and sync from step periods and the busiest replica's `compute` records, detection
from fault -> member_dead, re-forming from member_dead -> recovery, start-up from run_start -> first
step, how far slow injection misses its factor), turning its
injected faults into a trace, and the comparison.
Does not own: running the real trainer (runtime/) or the simulator's strategies; a real run is predicted
with `unbroken_live`, the strategy the trainer implements.

Approximations, stated: each replica is one process (tp = pp = 1, one GPU a node); a hang is a fail-stop
declared after the measured detection time; a killed replica never comes back.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.events import read_events
from unbroken.faultspec import Fault, parse
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import Scenario, from_tree

DEFAULT_DETECT = 1.5  # s: CoordConfig.heartbeat_timeout, used when the log shows no detection


@dataclass(frozen=True)
class Calibration:
    scenario: Scenario
    startup: float  # s from run_start to the first step's start (spawn, imports, group formation)
    steps: int  # steps the real run committed
    measured_wall: float  # s from run_start to the last committed step
    measured_tokens: int
    stretch: dict[str, float]  # slow injection's measured overshoot of its factor, per `how` (_stretch)


@dataclass(frozen=True)
class Prediction:
    measured_wall: float
    predicted_wall: float
    measured_tokens: int
    predicted_tokens: int

    @property
    def wall_error(self) -> float:
        """Relative error of the predicted wall time (0.1 = 10%)."""
        return abs(self.predicted_wall - self.measured_wall) / self.measured_wall


def boundaries(recs: list[dict[str, Any]]) -> dict[int, float]:
    """When each step's work was done: the end of the last successful reduction of that step, by anyone
    (every member's ends together: it is a collective), keyed by step. Falls back to the step records'
    times where a log has no `reduce` events. Why not the records: a member stepping ahead writes step
    s's record after it has computed step s+1's microbatches (runtime/trainer/speculation.py), so a record's
    time moves by up to a step with who wrote it, while the reduction's end does not."""
    ends: dict[int, float] = {}
    for r in recs:
        if r["event"] == "reduce" and r.get("ok"):
            ends[r["step"]] = max(ends.get(r["step"], 0.0), r["t"])
    committed = {r["step"]: r["t"] for r in recs if r["event"] == "step"}
    return {s: ends.get(s, t) for s, t in committed.items()}


def scenario_from_run(run_dir: str | Path) -> Calibration:
    """Build a scenario from a real run directory. Raises ValueError if the log has no committed step."""
    recs = read_events(Path(run_dir) / "events.jsonl")
    start = next(r for r in recs if r["event"] == "run_start")
    steps = sorted((r for r in recs if r["event"] == "step"), key=lambda r: r["step"])
    if not steps:
        raise ValueError(f"{run_dir}: no committed step in events.jsonl")
    faults = [r for r in recs if r["event"] == "fault"]
    fault_steps = {r.get("step") for r in faults}
    # The step period is the interval between step boundaries: a step record's own step_time leaves
    # out the work between steps (plan, digest, events), which a replay of the run's wall time must include.
    # Only steps before the first fault: after a kill fewer replicas share the microbatches, and reading
    # those periods as full-membership steps would book the survivors' extra compute as sync.
    ends = boundaries(recs)
    R, M = int(start["replicas"]), int(start["microbatches"])
    spec = parse(start.get("faults") or "", R, int(start["steps"]))
    first = _first_faulted(spec, default=float("inf"))
    gaps = [ends[s] - ends[s - 1] for s in sorted(ends) if s - 1 in ends and s < first]
    clean = gaps or [r["step_time"] for r in steps if r["step"] not in fault_steps] or \
        [r["step_time"] for r in steps]
    step_time = statistics.median(clean)
    per_replica = -(-M // R)
    # A step's sync is what its period spends beyond the busiest replica's compute (the reduction, the
    # optimizer, the records), not beyond a median replica's: two replicas' computes differ by up to 40%
    # here from step to step (measured: 24 ms against 34 ms a microbatch, each on a core of its own), and
    # that imbalance is no fixed cost: a slowed replica's steps end with its own compute, not its peer's.
    critical = _busiest(recs, {s for s in ends if s < first and s - 1 in ends})
    sync = statistics.median(step_time - c for c in critical) if critical else 0.0
    sync = min(max(sync, 0.0), step_time)
    t_mb = (step_time - sync) / per_replica
    t0 = steps[0]["t"] - steps[0]["step_time"]  # the simulated clock starts when step 0 starts
    dead = [r for r in recs if r["event"] == "member_dead"]
    detect = [d["t"] - f["t"] for f in faults for d in dead[:1] if d["t"] >= f["t"]]
    redo = [r for r in recs if r["event"] == "recovery"]
    reform = [redo[0]["t"] - dead[0]["t"]] if redo and dead and redo[0]["t"] >= dead[0]["t"] else []
    wall = steps[-1]["t"] - start["t"]
    trace = [_trace(f, t0) for f in faults if f["t"] >= t0]
    tree: dict[str, Any] = {
        "name": f"calibrated-{Path(run_dir).name}", "source": str(run_dir),
        "cluster": {"dp": R, "tp": 1, "pp": 1, "gpus_per_node": 1},
        "workload": {"microbatches": M, "tokens_per_microbatch": max(1, steps[0]["tokens"] // M),
                     "microbatch_seconds": t_mb, "sync_seconds": sync,
                     "duration_hours": 3 * wall / 3600 + 1 / 3600},
        "costs": {"detect_seconds": statistics.median(detect) if detect else DEFAULT_DETECT,
                  "reform_seconds": max(0.0, reform[0]) if reform else 0.0, "restart_seconds": t0 - start["t"],
                  "reload_seconds": 0.0, "checkpoint_seconds": 0.0, "snapshot_seconds": 0.0,
                  "memory_restore_seconds": 0.0, "rejoin_seconds": 0.0, "replace_seconds": float("inf")},
        "trace": [e for e in trace if e["at_hours"] < 3 * wall / 3600],
    }
    return Calibration(from_tree(tree, tree["name"]), t0 - start["t"], len(steps), wall,
                       sum(r["tokens"] for r in steps), _stretch(recs, spec))


def _busiest(recs: list[dict[str, Any]], steps: set[int]) -> list[float]:
    """Per step of `steps`: the wall seconds of compute of the replica that computed longest in it."""
    per: dict[tuple[int, int], float] = {}
    for r in recs:
        if r["event"] == "compute" and r.get("step") in steps:
            key = (r["step"], r["replica"])
            per[key] = per.get(key, 0.0) + r.get("wall", r["seconds"])
    busiest: dict[int, float] = {}
    for (step, _), seconds in per.items():
        busiest[step] = max(busiest.get(step, 0.0), seconds)
    return list(busiest.values())


def _own_speed(recs: list[dict[str, Any]], replica: int, before: int) -> float | None:
    """A replica's median microbatch wall seconds over steps 1 .. before-1 (step 0 left out: warm-up)."""
    mine = [r.get("wall", r["seconds"]) for r in recs if r["event"] == "compute" and r["replica"] == replica
            and 1 <= r["step"] < before]
    return statistics.median(mine) if mine else None


def _first_faulted(spec: tuple[Fault, ...], default: float) -> float:
    """The first step a fault of the spec touches (a slow stretch: its first slowed step)."""
    return min((f.start if f.kind == "slow" else f.step for f in spec), default=default)


def _stretch(recs: list[dict[str, Any]], spec: tuple[Fault, ...]) -> dict[str, float]:
    """How far this host's slow injection misses its factor, per `how`: the slowed replica's median
    microbatch wall time while slowed, over its own before the episode (step 0 left out: warm-up), over
    the factor. how=spin aims at F x the replica's own unslowed device time (runtime/trainer/faults.py), so it
    measures ~1.0 (0.998 and 1.04 here); it was 1.12 when the spin burned (F-1) x each slowed span's own
    compute, which the spin itself had slowed (its caches refilled after each spin)."""
    ratios: dict[str, list[float]] = {}
    for f in spec:
        if f.kind != "slow" or f.seconds:  # a fixed stall (for=) is no multiple of the compute
            continue
        before = _own_speed(recs, f.replica, f.start)
        during = [r.get("wall", r["seconds"]) for r in recs if r["event"] == "compute"
                  and f.slows(r["replica"], r["step"])]
        if before and during:
            ratios.setdefault(f.how, []).append(statistics.median(during) / before / f.factor)
    return {how: statistics.median(r) for how, r in ratios.items()}


def _trace(fault: dict[str, Any], t0: float) -> dict[str, Any]:
    at = (fault["t"] - t0) / 3600
    if fault.get("kind") == "slow":
        return {"at_hours": at, "cause": "slow", "scope": "slow", "factor": float(fault.get("factor", 2.0)),
                "duration_seconds": 1e9}
    return {"at_hours": at, "cause": str(fault.get("kind", "fault")), "scope": "gpu"}


def _predicted_fault(f: Fault, steps: int, step_time: float, compute: float, sync: float,
                     stretch: float = 1.0, microbatch: float | None = None) -> dict[str, Any]:
    """A fault of the spec on the failure-free clock (step s runs from s * step_time; `compute` s of it is
    one replica's microbatches). The simulator applies a slow episode at the next step boundary, so one
    that slows steps [start, stop) begins half a step before `start` and ends half a slowed step before
    `stop`; a kill or hang lands inside its step where its phase is (mid-compute, at the reduction, at
    the commit, after it), as the runtime fires it. A slow factor is scaled by the calibration run's
    measured `stretch` for its `how`. A fixed stall (`for=S`: S s of sleep after each microbatch's
    compute, `microbatch` s long unslowed) is applied as the factor it amounts to, + S / microbatch: the
    simulator slows a replica only by a factor."""
    if f.kind == "slow":
        factor = f.factor * stretch + (f.seconds / microbatch if f.seconds and microbatch else 0.0)
        slowed = compute * factor + sync  # a slowed step, equal quotas (the stated premise)
        end = steps + 1 if f.stop is None else f.stop
        return {"at_hours": (f.start - 0.5) * step_time / 3600, "cause": "slow", "scope": "slow",
                "factor": factor, "duration_seconds": 0.5 * step_time + (end - f.start - 0.5) * slowed}
    into = {"compute": 0.5 * compute, "allreduce": compute, "commit": compute + 0.5 * sync,
            "optimizer": compute + 0.9 * sync}[f.phase or "compute"]
    return {"at_hours": (f.step * step_time + into) / 3600, "cause": f.kind, "scope": "gpu"}


def predict(run_dir: str | Path) -> Prediction:
    """Simulate the real run described by `run_dir` and compare wall time and committed tokens."""
    cal = scenario_from_run(run_dir)
    res = simulate(cal.scenario, "unbroken_live", seed=0, log_steps=True, keep=True)
    steps = [r for r in res.records if r["event"] == "step"]
    done = [r["t"] for r in steps if r["step"] == cal.steps - 1]
    predicted_wall = cal.startup + (done[0] if done else res.end["seconds"])
    horizon = cal.measured_wall - cal.startup
    tokens = sum(r["tokens"] for r in steps if r["t"] <= horizon + 1e-9 and r["step"] < cal.steps)
    return Prediction(cal.measured_wall, predicted_wall, cal.measured_tokens, tokens)


def predict_other(calibration_dir: str | Path, target_dir: str | Path) -> Prediction:
    """Predict what another real run's faults cost. Every cost (the split of a step into microbatch
    compute and sync, detection, re-forming, how far a slow injection misses its factor) is read off
    `calibration_dir`; of `target_dir` only what a user states before running it (replicas,
    microbatches, steps, its fault spec from run_start: kills and hangs at their step, slow stretches
    from their first to their last step) and the machine's
    speed in that minute: its median step period before its first fault, which scales the calibrated
    compute and sync (a shared machine's speed drifts 2x between runs a minute apart; so the figure is
    what the faults cost, not how fast the host was), and the replicas' own microbatch times before the
    fault (a kill's survivors compute at theirs; a slowed replica is F times as slow as itself: `own`).
    Measured and predicted (`*_wall`): seconds from the end of the step before the first fault to the end
    of the last step (`boundaries`); start-up is not simulated. Raises ValueError if either log lacks steps, or the target a fault after its step 3."""
    cal = scenario_from_run(calibration_dir)
    recs = read_events(Path(target_dir) / "events.jsonl")
    start = next(r for r in recs if r["event"] == "run_start")
    commit = boundaries(recs)
    n, R, M = int(start["steps"]), int(start["replicas"]), int(start["microbatches"])
    spec = parse(start["faults"], R, n)
    first = _first_faulted(spec, default=0)
    gaps = [commit[s] - commit[s - 1] for s in range(2, first) if s in commit and s - 1 in commit]
    if not gaps or n - 1 not in commit or first - 1 not in commit:
        raise ValueError(f"{target_dir}: needs every step committed and a first fault after step 3")
    w = cal.scenario.workload
    cal_step = -(-w.microbatches // cal.scenario.cluster.dp) * w.microbatch_seconds + w.sync_seconds
    scale = statistics.median(gaps) / cal_step  # this minute's host speed against the calibration's
    mb, sync = w.microbatch_seconds * scale, w.sync_seconds * scale
    # After a kill the survivors compute every microbatch: at their own speed, read off the target's
    # steps before the fault, not the calibrated one, which a step's busiest replica sets (two pinned
    # replicas' microbatches took 24 and 34 ms side by side here). Measured on 6 run pairs: 0.6-2.8% off
    # with it, 0.3-18.2% with the scaled calibrated time.
    killed = {f.replica for f in spec if f.kind in ("kill", "hang")}
    survivors = [o for o in (_own_speed(recs, r, first) for r in range(R) if r not in killed) if o]
    if killed and survivors:
        mb = statistics.median(survivors)
    step_time = -(-M // R) * mb + sync
    # A slowed replica is F times as slow as it itself was before (faults.Injector.stretch aims at its own
    # unslowed spans), which need not be the median replica's speed: its own, read off the target's steps
    # before the fault, scales the factor the simulator applies to the common microbatch time.
    def own(f: Fault) -> float:
        speed = _own_speed(recs, f.replica, f.start) if f.kind == "slow" else None
        return speed / mb if speed else 1.0

    trace = [_predicted_fault(f, n, step_time, -(-M // R) * mb, sync, cal.stretch.get(f.how, 1.0) * own(f), mb)
             for f in spec if f.kind in ("slow", "kill", "hang")]
    tree: dict[str, Any] = {
        "name": f"predicted-{Path(target_dir).name}", "source": str(target_dir),
        "cluster": {"dp": R, "tp": 1, "pp": 1, "gpus_per_node": 1},
        "workload": {"microbatches": M, "tokens_per_microbatch": w.tokens_per_microbatch,
                     "microbatch_seconds": mb, "sync_seconds": sync,
                     "duration_hours": 4 * n * step_time * M / 3600 + 1 / 60},
        "costs": {f: getattr(cal.scenario.costs, f) for f in cal.scenario.costs.__dataclass_fields__},
        "trace": trace,
    }
    res = simulate(from_tree(tree, tree["name"]), "unbroken_live", seed=0, log_steps=True, keep=True)
    done = [r["t"] for r in res.records if r["event"] == "step" and r["step"] == n - 1]
    predicted = (done[0] if done else res.end["seconds"]) - first * step_time
    tokens = sum(r["tokens"] for r in recs if r["event"] == "step")
    return Prediction(commit[n - 1] - commit[first - 1], predicted, tokens, n * (tokens // len(commit)))


def main(argv: list[str] | None = None) -> int:
    """`python -m unbroken.sim.calibrate costs SCENARIO.toml ...`: print each derived cost and its source
    (sim/costmodel.py) beside the scenario's chosen costs. Exit 2 with one line on bad input."""
    import sys

    from unbroken.sim import costmodel
    from unbroken.sim.scenario import ScenarioError, load
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "costs":
        print("usage: python -m unbroken.sim.calibrate costs SCENARIO.toml [...]", file=sys.stderr)
        return 2
    for path in args[1:]:
        try:
            print(costmodel.table(load(path)) + "\n")
        except ScenarioError as e:
            print(f"calibrate: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
