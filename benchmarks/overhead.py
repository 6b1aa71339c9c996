"""Failure-free overhead: unbroken's steady-state step time against plain DistributedDataParallel.

Both sides do the same work (see benchmarks/_ddp_baseline.py): the same GPT, the same microbatches, M of
them a step split evenly across R real processes on gloo, one torch thread each, AdamW. unbroken runs
through its own launcher (coordinator, heartbeats, store protocol, copy-then-reduce, digests, events);
the baseline is DDP with `no_sync()` accumulation.

Step time: unbroken's from its `step` records (the median of differences of consecutive records' `t`);
the baseline's from rank 0's wall clock after each optimizer step, the same way. The first --warmup
intervals of every run are dropped (allocator, first bucket rebuild, page faults). The two run alternately
in ABBA order (unbroken, DDP | DDP, unbroken | ...: --rounds rounds; an extra run after some rounds)
because this machine is shared and its speed drifts from minute to minute; each run's figure is the
median of its steady-state intervals; the overhead is unbroken's best run over DDP's best run (shared
machine: interference only adds time, so the fastest of repeated runs estimates the undisturbed speed,
as timeit takes the minimum); the median over rounds of each round's ratio and the pooled ratio of all
intervals are printed too, with a 95% bootstrap interval of the per-round median (how tightly one
run pins the ratio down on this machine). unbroken runs with `run.quotas=equal` (M/R microbatches per
replica, DDP's split); the extras are --exact and the default `quotas=speed`, which rebalances toward
faster replicas (their ratios are pooled medians of one run each).

Prints a table, extra ratio lines for --exact (float64 accumulation and reduction) and quotas=speed, and
last `ratio overhead <unbroken / DDP>` for the default float32 mode with equal quotas, the fair
comparison (target <= 1.03).
Usage: python benchmarks/overhead.py [--rounds 8] [--steps 25] [--replicas 4] [--microbatches 8]
       [--n-layer 2] [--n-embd 64] [--extras 2]
"""
from __future__ import annotations

import argparse
import random
import socket
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _ddp_baseline when run from anywhere
import _ddp_baseline  # noqa: E402

from unbroken.api import make_config  # noqa: E402
from unbroken.events import read_events  # noqa: E402
from unbroken.runtime.launch import launch  # noqa: E402


def intervals(times: list[float], warmup: int) -> list[float]:
    """Differences of consecutive step times, the first `warmup` dropped."""
    return [b - a for a, b in zip(times, times[1:])][warmup:]


def run_unbroken(cfg, out: Path, warmup: int) -> tuple[list[float], dict[str, list[float]]]:
    """Step times of one unbroken run, and each replica's steady-state step split into parts."""
    result = launch(cfg, title="overhead")
    if not result.ok:
        raise RuntimeError(f"unbroken run failed: {result.error} (see {out})")

    records = read_events(out / "events.jsonl")
    committed = sorted((r for r in records if r["event"] == "step"), key=lambda r: r["step"])
    # Per replica and step: time between its own optimizer steps ("applied"), its forward/backward
    # seconds, its all-reduce seconds (which include waiting for the slowest peer); the rest is data,
    # the store protocol (plan, done count, decision), the optimizer step, the digest and event writes;
    # "waited" is the part of the rest a member spent waiting for the peer that proposes the commit (a
    # second synchronisation point a step, which DDP does not have: its ranks part after the all-reduce).
    applied, waited, compute, reduce = {}, {}, {}, {}
    for r in records:
        key = (r.get("replica"), r.get("step"))
        if r["event"] == "applied":
            applied[key], waited[key] = r["t"], r["waited"]
        elif r["event"] == "compute":
            compute[key] = compute.get(key, 0.0) + r["seconds"]
        elif r["event"] == "reduce" and r["ok"]:
            reduce[key] = reduce.get(key, 0.0) + r["seconds"]
    parts: dict[str, list[float]] = {"compute": [], "reduce": [], "rest": [], "waited": []}
    for (rep, s), t in applied.items():
        if s > warmup and (rep, s - 1) in applied:
            interval = t - applied[(rep, s - 1)]
            parts["compute"].append(compute.get((rep, s), 0.0))
            parts["reduce"].append(reduce.get((rep, s), 0.0))
            parts["rest"].append(interval - parts["compute"][-1] - parts["reduce"][-1])
            parts["waited"].append(waited[(rep, s)])  # part of the rest
    return [r["t"] for r in committed], parts


def bootstrap_ci(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of `ratios` (rounds resampled with replacement):
    how far this machine's drift lets one run of the benchmark pin the ratio down."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="alternations of unbroken / DDP")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=4, help="step intervals dropped at the start of each run")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--extras", type=int, default=2, help="extra runs, one per round: --exact, then quotas=speed")
    args = ap.parse_args()
    console = Console(width=120)
    t_start = time.time()
    base = dict(replicas=args.replicas, steps=args.steps, microbatches=args.microbatches, progress=False,
                model__n_layer=args.n_layer, model__n_embd=args.n_embd)
    # Extras, one per round while rounds last: --exact, and the default speed-weighted quotas (which move
    # microbatches to whichever replica this shared machine happens to favour: not the same even split).
    extras = ["unbroken --exact", "unbroken quotas=speed"][:args.extras]
    samples: dict[str, list[float]] = {"unbroken": [], "ddp": [], **{x: [] for x in extras}}
    per_run: dict[str, list[float]] = {k: [] for k in samples}
    parts: dict[str, list[float]] = {"compute": [], "reduce": [], "rest": [], "waited": []}
    tmp = tempfile.mkdtemp(prefix="overhead-")  # removed on success; kept to read when a run fails

    def measure(name: str, rnd: int) -> list[float]:
        if name == "ddp":
            return _ddp_baseline.spawn(make_config(**base), free_port())
        out = Path(tmp) / f"{name.replace(' --', '-').replace('=', '-')}-{rnd}"
        # equal quotas: M/R microbatches per replica every step, the split DDP has
        cfg = make_config(**base, exact=name.endswith("exact"), out=str(out),
                          quotas="speed" if name.endswith("speed") else "equal")
        times, p = run_unbroken(cfg, out, args.warmup)
        if name == "unbroken":
            for k in parts:
                parts[k].extend(p[k])
        return times

    for rnd in range(args.rounds):
        # ABBA order (unbroken, DDP | DDP, unbroken | ...): a speed drift within two rounds cancels
        pair = ["unbroken", "ddp"] if rnd % 2 == 0 else ["ddp", "unbroken"]
        for name in pair + extras[rnd:rnd + 1]:
            with console.status(f"round {rnd + 1}/{args.rounds}: {name}"):
                times = measure(name, rnd)
            got = intervals(times, args.warmup)
            samples[name].extend(got)
            per_run[name].append(statistics.median(got))
            console.print(f"round {rnd + 1} {name:>17}: median step {1e3 * per_run[name][-1]:7.1f} ms "
                          f"({len(got)} intervals)")

    med = {k: statistics.median(v) for k, v in samples.items() if v}
    shutil.rmtree(tmp, ignore_errors=True)
    t = Table(title=f"failure-free step time: {args.replicas} processes, {args.microbatches} microbatches/step, "
                    f"{args.rounds} rounds x {args.steps} steps", title_justify="left")
    for col in ("system", "median step ms", "per-run medians ms", "intervals", "vs DDP"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for name, m in med.items():
        t.add_row(name, f"{1e3 * m:.1f}", " ".join(f"{1e3 * x:.1f}" for x in per_run[name]),
                  str(len(samples[name])), f"{m / med['ddp']:.3f}")
    console.print(t)
    paired = [u / d for u, d in zip(per_run["unbroken"], per_run["ddp"])]  # same minute, similar load
    console.print("unbroken / DDP by round (neighbouring runs): " + " ".join(f"{x:.3f}" for x in paired))
    console.print(f"pooled medians (every interval of every round): unbroken / DDP {med['unbroken'] / med['ddp']:.3f}")
    m = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    console.print(f"unbroken default, per replica and step (medians): forward/backward {m['compute']:.1f} ms, "
                  f"all-reduce incl. waiting for peers {m['reduce']:.1f} ms, rest (data, store protocol, "
                  f"optimizer, digest, events) {m['rest']:.1f} ms; of the rest, waiting for a peer's commit "
                  f"decision (after any step ahead, run.step_ahead): mean {1e3 * statistics.fmean(parts['waited']):.1f} ms")
    console.print(f"wall time {time.time() - t_start:.0f} s")
    for x in (x for x in extras if x in med):
        print(f"ratio overhead {x.removeprefix('unbroken ').removeprefix('--')} {med[x] / med['ddp']:.3f}")
    # The figure: each side's best run (the lowest of its per-run median step times) over the other's.
    # This machine is shared, and a neighbour's burst slowed single runs of either side by up to 2x
    # while the next minute was clean (per-run medians 49.6 and 98.2 ms for the same DDP config); such
    # interference only ever adds time, so, as timeit does, the fastest of repeated runs estimates the
    # undisturbed speed. Both sides get the same number of runs, interleaved ABBA.
    best = min(per_run["unbroken"]) / min(per_run["ddp"])
    lo, hi = bootstrap_ci(paired)
    console.print(f"median over rounds of unbroken / DDP: {statistics.median(paired):.3f} (95% bootstrap "
                  f"interval over rounds {lo:.3f}-{hi:.3f}); best run over best run: {best:.3f}")
    print(f"ratio overhead {best:.3f}")


if __name__ == "__main__":
    main()
