"""`unbroken detect-eval`: fail-slow detection judged on real multi-process runs, beside the baselines.

Owns: drawing N slowdown episodes (replica, factor 1.1-3x log-uniform, random onset and duration), running
one real `unbroken train` per episode with that `slow:...,from=A,to=B` fault on variable-length data,
turning each run's event log into a `replay.Trace` (ground truth from the fault spec, observations
from the `compute` events of the microbatches each committed step reduced), and scoring:
  unbroken (live)    the coordinator's own `verdict` events, as logged during the run;
  unbroken (replay)  a fresh Detector on the same recorded timings (its predictor gives the error column;
                     it should agree with the live row, which saw the same timings from the store);
  baselines          threshold / z-score / NVIDIA-relative from replay.py, on the same timings.
Beside them, the noise of each run: the detector's own (its last `noise` record, policy/noise.py: its
thresholds follow it) and the host's, measured from the raw compute records apart from the detector
(eval/host.py), with the slowdown the slowed replica's device time showed; then the noise sweep of
sweep.py (trace replay of the same shape at replica-step noise 0.05-0.2).
Does not own: the detector, the baselines or the alarm/episode accounting (replay.py), training.

The runs use equal quotas (`--run.quotas=equal`): the detector still runs and logs its verdicts, but
work is never moved, so every method sees the same open-loop observations (moving work off a slow
replica would shorten its step time and hide it from the step-time baselines). Every method reads the
same per-microbatch device time (runtime/trainer/devicetime.py: the computing thread's CPU time here), the
`seconds` of each `compute` event. Slowness is a spin in the computing thread until the microbatch has
taken factor x the replica's own unslowed device time (runtime/trainer/faults.py, how=spin): it shows on that
clock as a throttled core would, and nothing else tells the detector. An alarm counts as true if it
falls in [onset, end + grace) of its replica's episode; false alarms are per 1,000 replica-steps;
recall above 1.3x counts the episodes of factor >= 1.3 only (below, a slowdown sits within the
detector's allowance: 8%, or one noise sd where the noise is larger).
"""
from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

from unbroken.eval import host
from unbroken.eval.replay import METHODS, Method, Slowdown, Tally, Trace, TraceConfig, recall_above, replay
from unbroken.policy.predictor import MicrobatchTiming


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `detect-eval` on the top-level parser's subparsers; `run(args)` executes it."""
    p = subparsers.add_parser("detect-eval", help="fail-slow detection on real runs with injected slowdowns, "
                                                  "against step-time baselines on the same timings")
    p.add_argument("--runs", type=int, default=4, help="real runs, one slowdown episode each (~50 s a run)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=16, help="per step; equal quotas: M/replicas each")
    p.add_argument("--factor", type=float, nargs=2, default=(1.1, 4.0), metavar=("LO", "HI"),
                   help="slowdown factors, log-uniform")
    p.add_argument("--duration", type=int, nargs=2, default=(8, 20), metavar=("LO", "HI"), help="steps")
    p.add_argument("--warmup", type=int, default=6, help="no slowdown starts before this step")
    p.add_argument("--seed", type=int, default=0, help="draws the episodes (and seeds the runs)")
    p.add_argument("--out", help="keep the runs under this directory (default: a temporary one)")
    p.add_argument("--sweep-seeds", type=int, default=12,
                   help="traces per noise level of the trace-replay sweep (0: no sweep)")
    return p


def draw_episode(rng: random.Random, replicas: int, steps: int, factor: tuple[float, float],
                 duration: tuple[int, int], warmup: int) -> Slowdown:
    """One slowdown inside the run: onset >= warmup, end <= steps (so every episode can be detected)."""
    dur = min(rng.randint(*duration), steps - warmup - 1)
    if dur < 1:
        raise ValueError(f"--steps {steps} leaves no room for an episode after --warmup {warmup}")
    onset = rng.randint(warmup, steps - dur)
    lo, hi = (math.log(f) for f in factor)
    return Slowdown(rng.randrange(replicas), onset, onset + dur, round(math.exp(rng.uniform(lo, hi)), 3))


def fault_spec(d: Slowdown) -> str:
    return f"slow:replica={d.replica},from={d.onset},to={d.end},factor={d.factor:g},how=spin"


def trace_of(records: list[dict], episode: Slowdown, replicas: int) -> tuple[Trace, dict[int, set[int]]]:
    """The run as replay.py sees a trace, plus the live detector's Slow set per committed step.

    Observations are the `compute` events of the microbatches each committed step's `owners` reduced
    (one per microbatch, the commit epoch's). Steps run 0..last committed; a gap (none expected without
    fail-stop faults) would be an empty step."""
    owners = {r["step"]: {int(k): set(v) for k, v in r["owners"].items()} for r in records if r["event"] == "step"}
    n = max(owners) + 1 if owners else 0
    steps: list[dict[int, list[MicrobatchTiming]]] = [{} for _ in range(n)]
    seen: set[tuple[int, int]] = set()
    for r in records:
        s = r.get("step")
        if r["event"] != "compute" or s not in owners or r["microbatch"] not in owners[s].get(r["replica"], ()):
            continue
        if (s, r["microbatch"]) in seen or not r["seconds"] > 0:
            continue
        seen.add((s, r["microbatch"]))
        steps[s].setdefault(r["replica"], []).append(MicrobatchTiming(r["tokens"], float(r["sumsq"]), r["seconds"]))
    cfg = TraceConfig(replicas=replicas, steps=n, slowdowns=1)
    trace = Trace(cfg, (episode,), None, tuple({k: tuple(v) for k, v in st.items()} for st in steps))
    slow_at: dict[int, set[int]] = {}
    current: set[int] = set()
    verdicts = sorted((r for r in records if r["event"] == "verdict"), key=lambda r: r["step"])
    it = iter(verdicts)
    nxt = next(it, None)
    for s in range(n):
        while nxt is not None and nxt["step"] <= s:
            (current.add if nxt["new"] == "slow" else current.discard)(nxt["replica"])
            nxt = next(it, None)
        slow_at[s] = set(current)
    return trace, slow_at


def live_method(slow_at: dict[int, set[int]]) -> Method:
    """The verdicts the coordinator logged, as a method replay can score."""
    return lambda s, timings: set(slow_at.get(s, ()))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from unbroken.api import make_config
    from unbroken.events import read_events
    from unbroken.runtime.launcher.launch import launch

    console = Console(width=150)
    if args.runs < 1 or args.replicas < 2 or args.microbatches < args.replicas:
        console.print("unbroken: error: need --runs >= 1, --replicas >= 2, --microbatches >= --replicas")
        return 2
    rng = random.Random(args.seed)
    names = ["unbroken (live)", "unbroken (replay)", *[k for k in METHODS if k != "unbroken"]]
    tallies = {k: Tally() for k in names}
    per_run = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="detect-eval-") as tmp:
        root = Path(args.out or tmp)
        for i in range(args.runs):
            ep = draw_episode(rng, args.replicas, args.steps, tuple(args.factor), tuple(args.duration), args.warmup)
            out = root / f"run-{i}"
            cfg = make_config(replicas=args.replicas, steps=args.steps, microbatches=args.microbatches,
                              seed=args.seed + i, faults__spec=fault_spec(ep), quotas="equal", launch__out=str(out),
                              launch__progress=False, data__seq_len="variable")
            with console.status(f"run {i + 1}/{args.runs}: {fault_spec(ep)}"):
                result = launch(cfg, title="detect-eval")
            if not result.ok:
                console.print(f"run {i + 1} failed: {result.error} (see {out})")
                return 1
            records = read_events(out / "events.jsonl")
            trace, slow_at = trace_of(records, ep, args.replicas)
            noise = run_noise(records, ep)
            for name in names:
                method = live_method(slow_at) if name == "unbroken (live)" else \
                    METHODS["unbroken"]() if name == "unbroken (replay)" else METHODS[name]()
                before = (tallies[name].alarms, tallies[name].false_alarms, len(tallies[name].latencies))
                replay(trace, method, tallies[name])
                if name == "unbroken (live)":
                    hit = len(tallies[name].latencies) > before[2]
                    per_run.append((fault_spec(ep), tallies[name].alarms - before[0],
                                    tallies[name].false_alarms - before[1],
                                    tallies[name].latencies[-1] if hit else None, *noise))
            console.print(f"run {i + 1}/{args.runs} {fault_spec(ep)}: live detection "
                          f"{'at +' + str(per_run[-1][3]) + ' steps' if per_run[-1][3] else 'missed'}, "
                          f"{per_run[-1][2]} false alarms, noise {noise[0]:.3f} (detector) {noise[1]:.3f} (host)")
    print_tables(console, tallies, per_run, args)
    if args.sweep_seeds > 0:
        from unbroken.eval.sweep import sweep, table
        console.print(table(sweep(range(args.sweep_seeds)), f"noise sweep, trace replay: {args.sweep_seeds} traces "
                            "a level x 300 steps x 4 replicas x 16 microbatches, one slowdown of 1.1-4x per 100 "
                            "steps; stated: the thresholds' latency at the noise measured (policy/noise.py)"))
    console.print(f"wall time {time.time() - t0:.0f} s")
    live = tallies["unbroken (live)"]
    m = live.metrics()
    print(f"ratio precision {m.precision:.3f}")
    print(f"ratio recall_above_1.3x {recall_above(live, 1.3):.3f}")
    print(f"ratio latency_steps_median {m.latency_median:g}")
    print(f"ratio noise_detector_median {median_of([r[4] for r in per_run]):.3f}")
    print(f"ratio false_alarms_per_1000_replica_steps {1000 * live.false_alarms / (live.steps * args.replicas):.3f}")
    return 0


def run_noise(records: list[dict], ep: Slowdown) -> tuple[float, float, float]:
    """A run's noise: the detector's (its last `noise` record's fleet figure; nan if none), the host's
    from the raw compute records outside the slowed replica's episode (eval/host.py), and the slowdown
    its device time showed over the episode, by the same records."""
    logged = [r["fleet"].get("default", math.nan) for r in records if r["event"] == "noise"]
    res = host.residuals(records)
    raw = host.noise(res, lambda s, r: r == ep.replica and ep.onset <= s < ep.end)
    return (logged[-1] if logged else math.nan), raw, host.slowdown(res, ep.replica, range(ep.onset, ep.end))


def median_of(xs: list[float]) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else math.nan


def print_tables(console, tallies: dict[str, Tally], per_run: list, args: argparse.Namespace) -> None:
    from rich.table import Table

    def fmt(x: float, spec: str = ".2f") -> str:
        return "-" if math.isnan(x) else format(x, spec)

    runs = Table(title="episodes (live verdicts)", title_justify="left")
    for col in ("fault spec", "alarms", "false", "latency steps", "noise (detector)", "noise (host)",
                "device time x"):
        runs.add_column(col, justify="left" if col == "fault spec" else "right")
    for spec, alarms, false, lat, det, raw, factor in per_run:
        runs.add_row(spec, str(alarms), str(false), "missed" if lat is None else str(lat), fmt(det, ".3f"),
                     fmt(raw, ".3f"), fmt(factor, ".2f"))
    console.print(runs)
    t = Table(title=f"{args.runs} real runs x {args.steps} steps x {args.replicas} replicas, variable-length data, "
                    f"equal quotas, one spin slowdown of {args.factor[0]:g}-{args.factor[1]:g}x each, device time; "
                    f"noise (log-sd of a replica-step's score) median {fmt(median_of([r[4] for r in per_run]), '.3f')} "
                    f"by the detector, {fmt(median_of([r[5] for r in per_run]), '.3f')} by the host's raw records",
              title_justify="left")
    for col in ("method", "precision", "recall", "recall >= 1.3x", "alarms", "false alarms",
                "false /1k replica-steps",
                "latency steps med (mean)", "predictor MdAPE"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, tally in tallies.items():
        m = tally.metrics()
        mdape = tallies["unbroken (replay)"].metrics().predictor_mdape if name.startswith("unbroken") else math.nan
        t.add_row(name, fmt(m.precision), fmt(m.recall), fmt(recall_above(tally, 1.3)), str(m.alarms),
                  str(m.false_alarms),
                  fmt(1000 * m.false_alarms / (m.steps * args.replicas), ".1f") if m.steps else "-",
                  f"{fmt(m.latency_median, 'g')} ({fmt(m.latency_mean, '.1f')})",
                  fmt(100 * mdape, ".1f") + ("%" if not math.isnan(mdape) else ""))
    console.print(t)


if __name__ == "__main__":  # python -m unbroken.eval.real_runs (also `unbroken detect-eval`)
    _ap = argparse.ArgumentParser(prog="unbroken")
    raise SystemExit(run(_ap.parse_args(["detect-eval", *__import__("sys").argv[1:]]) if add_parser(
        _ap.add_subparsers(dest="command")) else 2))
