"""Throughput with one 2x slow replica: speed-weighted quotas against equal quotas, and against the ideal.

Owns: running both quota policies and a failure-free run alternately through unbroken's own launcher on
real processes, picking each run's steady state from its event log, and the ideal it is measured against.
Does not own: detection (the coordinator's detector decides the speeds from measured times; it never sees
the fault spec) or the slowness injection (runtime/faults.py: (factor-1) x the measured compute after
each microbatch, here with how=spin: the CPU is burnt meanwhile, so on 2 cores shared by 4 replicas the
slow one keeps its share of the CPU and is `factor` times slower at it, as a throttled GPU beside healthy
ones; a sleeping replica would hand its core to the others and show ~2.4x for factor 2, see README).

Setup: R replicas (default 4), replica R-1 slowed `--factor` (2x) from step 0, fixed-length sequences (so
every microbatch holds the same work and "one healthy microbatch's time" is well defined), a model big
enough that compute dominates coordination. M defaults to 28 microbatches a step: with speeds
1,1,1,0.5 (3.5 replica-equivalents) integral quotas 8,8,8,4 match the speeds exactly, so the ideal is
reachable without rounding loss. M is a flag; the script says in its output whether quotas can match.

Step times are measured in each run's own healthy-microbatch time: a run's median step interval (commit
to commit, over steady-state steps: from the first step whose quotas then stay the same to the end of
the run, not before --warmup) over the median compute time of one microbatch of a healthy replica in
those steps. The host's speed drifts between runs by more than the effect measured; within one run it
moves step and microbatch times alike, so the unit cancels it. The detector runs in every mode (equal
quotas only ignore its speeds), so all use the same rule.

Ideal (the headline): the sum of the replicas' speeds, as throughput. A failure-free run of the same
configuration (no slow replica, equal quotas; same CPU contention: 4 busy replicas either way) commits
M microbatches every n_ff units; R-1 healthy replicas and one at 1/factor speed can at best commit them
every n_ff x R / S, S = (R-1) + 1/factor. The failure-free runs alternate with the others in every round.
Stricter figure, printed too: compute only, M / S units, which charges the per-step costs that do not
shrink with fewer microbatches (all-reduce, commit, optimizer step) to the policy.

Two windows, the same for every mode: "whole run" = every step interval from step --first on (default 1:
only step 0's start-up is left out), so the detection transient (the steps at equal quotas before the
slow replica is declared, and the change of quotas) is inside the headline; "steady" = as above, from the
first step whose quotas then stay the same, printed beside it (it leaves the transient out).

Last line: `ratio of_ideal VALUE` = n_ff x R / S over the speed-quota runs' median, whole run (target
>= 0.95). Printed above it: the steady-state figure, and the equal-quota figures against the same ideal. Approximate by nature:
2 shared CPU cores run R trainer processes and a coordinator, and a replica computes faster while its
peers wait (equal quotas gain from it: the slow replica has the cores to itself at each step's end).
Usage: python benchmarks/slow_replica.py [--rounds 3] [--steps 30] [--microbatches 28] [--factor 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.api import make_config
from unbroken.events import read_events
from unbroken.runtime.launch import launch


def integral_quotas_match(m: int, speeds: list[float]) -> list[int] | None:
    """Quotas proportional to `speeds` summing to `m`, if they are all whole numbers (else None)."""
    total = sum(speeds)
    q = [m * s / total for s in speeds]
    return [round(x) for x in q] if all(abs(x - round(x)) < 1e-9 for x in q) else None


def steady(records: list[dict], slow: int, warmup: int) -> tuple[list[int], int | None]:
    """Steady-state steps of one run (first kept step onward), and the step the slow replica became Slow.

    Steady: from the first step whose quotas stay as they are to the end of the run (the policy has
    converged; the step after a change is left out too, its interval began under the old quotas), and
    never before `warmup`."""
    declared = next((r["step"] for r in records if r["event"] == "verdict" and r["replica"] == slow
                     and r["new"] == "slow"), None)
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    order = sorted(steps)
    quotas = {s: sorted((int(k), len(v)) for k, v in steps[s]["owners"].items()) for s in order}
    settled = order[0] if order else 0
    for a, b in zip(order, order[1:]):
        if quotas[a] != quotas[b]:
            settled = b + 1
    return [s for s in order if s >= max(warmup, settled)], declared


def measure(records: list[dict], keep: list[int], slow: int) -> dict[str, object]:
    """Step-time intervals, healthy microbatch compute times and quotas over the steps in `keep`."""
    t = {r["step"]: r["t"] for r in records if r["event"] == "step"}
    owners = {r["step"]: r["owners"] for r in records if r["event"] == "step"}
    kept = set(keep)
    intervals = [t[s] - t[s - 1] for s in keep if s - 1 in t]  # commit to commit, s
    healthy = [r["seconds"] for r in records if r["event"] == "compute" and r["step"] in kept
               and r["replica"] != slow]
    slow_mb = [r["seconds"] for r in records if r["event"] == "compute" and r["step"] in kept
               and r["replica"] == slow]
    last = owners[max(keep)] if keep else {}
    return {"intervals": intervals, "healthy": healthy, "slow": slow_mb,
            "quotas": [len(last.get(str(r), [])) for r in sorted(int(k) for k in last)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of speed / equal quotas / failure-free")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=4, help="first step counted in steady state, at the earliest")
    ap.add_argument("--first", type=int, default=1, help="first step interval of the whole-run window (s-1 -> s)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=28)
    ap.add_argument("--factor", type=float, default=2.0, help="slowdown of the last replica, from step 0")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=128, help="fixed tokens per sequence (= block size)")
    args = ap.parse_args()
    console = Console(width=130)
    t_start = time.time()
    slow = args.replicas - 1
    speeds = [1.0] * slow + [1.0 / args.factor]
    match = integral_quotas_match(args.microbatches, speeds)
    if match:
        console.print(f"M = {args.microbatches} chosen so integral quotas can match the speeds "
                      f"{speeds}: {match} (no rounding loss against the ideal)")
    else:
        console.print(f"M = {args.microbatches}: quotas cannot match speeds {speeds} exactly; "
                      f"rounding costs some of the ideal (M = 28 matches 4 replicas at 2x)")
    base = dict(replicas=args.replicas, steps=args.steps, microbatches=args.microbatches, progress=False,
                faults=f"slow:replica={slow},from=0,factor={args.factor:g},how=spin",
                model__n_layer=args.n_layer, model__n_embd=args.n_embd, model__block_size=args.seq_len,
                data__batch_size=args.batch_size, data__seq_len=str(args.seq_len))
    modes = ("speed", "equal", "none")  # none: the failure-free run the ideal is scaled from
    units: dict[str, list[float]] = {q: [] for q in modes}  # per run: median step / median healthy mb
    whole: dict[str, list[float]] = {q: [] for q in modes}  # the same over the whole-run window (mean step)
    rows = []
    with tempfile.TemporaryDirectory(prefix="slow-replica-") as tmp:
        for rnd in range(args.rounds):
            for quotas in modes:
                out = Path(tmp) / f"{quotas}-{rnd}"
                run = dict(base, quotas="equal", faults="") if quotas == "none" else dict(base, quotas=quotas)
                with console.status(f"round {rnd + 1}/{args.rounds}: {quotas} quotas"):
                    result = launch(make_config(**run, out=str(out)), title="slow replica")
                if not result.ok:
                    raise SystemExit(f"run failed: {result.error} (see {out})")
                records = read_events(out / "events.jsonl")
                keep, declared = steady(records, slow, args.warmup)
                m = measure(records, keep, slow)
                if m["intervals"] and m["healthy"]:
                    med = statistics.median(m["intervals"])  # type: ignore[arg-type]
                    t_h = statistics.median(m["healthy"])  # type: ignore[arg-type]
                    units[quotas].append(med / t_h)
                else:  # quotas still moving at the end: no steady state; the whole-run figure stands
                    console.print(f"[yellow]no steady-state steps in the {quotas} run of round {rnd + 1} "
                                  f"(quotas changed until the end): raise --steps for the steady figure")
                    med = t_h = float("nan")
                    keep = keep or [-1]
                all_steps = sorted(r["step"] for r in records if r["event"] == "step" and r["step"] >= args.first)
                w = measure(records, all_steps, slow)
                # the mean, not the median: the transient is a few slow steps, a median would drop them
                whole[quotas].append(statistics.fmean(w["intervals"]) / statistics.median(w["healthy"]))
                rows.append((rnd + 1, quotas, declared, keep[0], len(keep), m["quotas"], med, t_h, med / t_h))
                console.print(f"round {rnd + 1} {quotas:>5}: slow declared at step {declared}, median step "
                              f"{1e3 * med:.1f} ms = {med / t_h:.2f} healthy microbatches, over {len(keep)} "
                              f"steps, quotas {m['quotas']}")
    t = Table(title=f"{args.replicas} replicas, replica {slow} {args.factor:g}x slow from step 0 (none: "
                    f"failure-free), M = {args.microbatches}, {args.rounds} rounds x {args.steps} steps",
              title_justify="left")
    for col in ("round", "quotas", "Slow at step", "steady from", "steps", "last quotas", "median step ms",
                "healthy mb ms", "step / mb"):
        t.add_column(col, justify="right")
    for rnd, q, d, k0, n, qs, med, th, u in rows:
        t.add_row(str(rnd), q, str(d), str(k0), str(n), str(qs), f"{1e3 * med:.1f}", f"{1e3 * th:.1f}", f"{u:.2f}")
    console.print(t)
    s_sum = sum(speeds)
    n_ff, n_speed, n_equal = (statistics.median(units[q]) if units[q] else float("nan")
                              for q in ("none", "speed", "equal"))
    ideal = n_ff * args.replicas / s_sum  # in healthy-microbatch times: sum of speeds, as throughput
    console.print(f"step times in healthy-microbatch times (each run's own, so that the host's drift "
                  f"between runs cancels): failure-free {n_ff:.2f}, ideal {n_ff:.2f} x {args.replicas} / "
                  f"{s_sum:g} = {ideal:.2f}, compute-only ideal M / {s_sum:g} = {args.microbatches / s_sum:.2f}; "
                  f"speed quotas {n_speed:.2f}, equal quotas {n_equal:.2f} "
                  f"(speed quotas {n_equal / n_speed:.2f}x faster)")
    console.print(f"wall time {time.time() - t_start:.0f} s")
    w_ff, w_speed, w_equal = (statistics.median(whole[q]) for q in ("none", "speed", "equal"))
    w_ideal = w_ff * args.replicas / s_sum
    console.print(f"whole run (steps {args.first}.. of each run, mean step, the detection transient included): "
                  f"failure-free {w_ff:.2f}, ideal {w_ideal:.2f}, speed quotas {w_speed:.2f}, equal {w_equal:.2f}")
    console.print("The ratios leave out: start-up and step 0 (all modes alike); a slow replica that recovers "
                  "(it stays slow to the end here).")
    print(f"ratio of_compute_only_ideal_steady {args.microbatches / s_sum / n_speed:.3f}")
    print(f"ratio of_ideal_equal_quotas_steady {ideal / n_equal:.3f}")
    print(f"ratio of_ideal_equal_quotas {w_ideal / w_equal:.3f}")
    print(f"ratio of_ideal_steady {ideal / n_speed:.3f}")
    print(f"ratio of_ideal {w_ideal / w_speed:.3f}")

if __name__ == "__main__":
    main()
