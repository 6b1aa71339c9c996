"""Goodput under successive failures: live recovery against whole-job restarts from memory and from disk.

What it measures: tokens committed per wall-clock second (run start to run end, start-up included) for
one schedule of successive replica kills, run under the recovery modes of `--run.recovery`:
  live            survivors finish the failed step and go on without the lost replicas (ReCoVer);
  live-rejoin     the same, and each killed replica's torchrun job restarts it (`--launch.restarts=N`):
                  it rejoins at a step boundary, healed from a live peer, so live gets its capacity
                  back as the restart modes do (no snapshots: it needs none);
  restart-memory  any failure restarts every trainer, which reload the agents' in-memory snapshot
                  (snapshot every step);
  restart-disk    any failure restarts every trainer from the latest DCP checkpoint, losing the steps since
                  (checkpoint-and-restart, the baseline of ReCoVer's 2.23x).
Each mode runs --rounds times (order live, live-rejoin, memory, disk, then reversed, ...) because the shared machine's
load drifts by 2x within minutes; the ratios use the pooled goodput (tokens / mean wall time of the mode).
Each step's tokens count once: a step redone after a restart is not new work. The committed-token curve
is the tokens of every step up to the highest step committed so far, so redone work shows as a plateau.

How the restart-disk interval is chosen (never tuned to a result): before the runs, this script builds the
run's model and AdamW in-process and times DCP checkpoints of that state (Checkpointer.save_async to the
checkpoint being complete on disk, Young's "time to write a checkpoint", median of --ckpt-reps). The
schedule's MTBF = the steps between failures x the failure-free step time measured in the live run before
its first failure (live runs first for that reason). `--checkpoint.every` = round(young_daly_interval(C,
MTBF) / step time), at least 1.

Every mode starts its replica groups the same way, one torchrun job per group as on a cluster
(`--launch.launcher=torchrun`), so every start, restart and rejoin pays what a real one pays here: new
processes, `import torch` and the first optimizer step's `import torch._dynamo` (~3 CPU-s a trainer on
this machine), group formation, the restore or the heal. That is part of what each strategy costs.
(Before 2026-11-29 the three modes without rejoin ran under the local launcher's default, `fork`, whose
trainers are forked from a process that imported torch once: their restarts skipped those ~3 CPU-s,
which no cluster's restart does, while live-rejoin's torchrun paid them.)

Capacity, the same story for every mode: each mode is charged the replica-seconds it holds. A restart
mode relaunches all R replicas (a spare replaces the failed one at once), so it holds R for the whole
run; the live run loses replicas for good (nothing replaces them yet), so it holds a replica until the
coordinator declares it dead. The ratio lines are of goodput per replica-second held (tokens / replica-
seconds); raw tokens per wall second, which flatters whichever mode holds more, is printed beside them.
For replica-seconds to be machine capacity, every replica must own a core: by default R = the number
of cores, one torch thread each (on 2 cores: 2 replicas, 1 failure). With more processes than cores
(4 on 2 cores) a lost replica frees no capacity until fewer than `cores` remain, and live would look
better than it is: the script warns.
A 4-process CPU run is not ReCoVer's 512-GPU run: the figure is this machine's, printed beside theirs.

Writes runs/goodput/{live,live-rejoin,restart-memory,restart-disk}/ and runs/goodput/goodput.png (`unbroken report`'s
picture of the live run, the restart runs' loss and committed tokens beside it). Last lines:
`ratio goodput_per_replica_s_live_over_restart_memory VALUE`, the live-rejoin ratios over restart-memory
and restart-disk, then `ratio goodput_per_replica_s_live_over_restart_disk VALUE`.
Usage: python benchmarks/goodput.py [--quick] [--rounds 2] [--steps 32] [--failures 3] [--out runs/goodput]
"""
from __future__ import annotations

import argparse
import atexit
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from unbroken.api import make_config
from unbroken.events import read_events
from unbroken.policy.snapshotting import young_daly_interval
from unbroken.runtime.persist.checkpoint import Checkpointer
from unbroken.runtime.launcher.launch import launch
from unbroken.runtime.persist.state import materialize, training_state
from unbroken.runtime.trainer.placement import default_factories
from unbroken.observe.plot import write_png
from unbroken.observe.report import timeline

MODES = ("live", "live-rejoin", "restart-memory", "restart-disk")
PHASES = ("compute", "allreduce", "optimizer")  # where the kills land, in turn
RECOVER_PAPER = 2.23  # ReCoVer: effective throughput vs checkpoint-and-restart, 512 GPUs (their figure)


def schedule(steps: int, failures: int, replicas: int) -> tuple[str, list[int]]:
    """Kills of different replicas (1, 2, ...; replica 0 always survives so live never has to restart)
    at steps spread evenly over the run, landing in different phases of the step protocol."""
    at = [round(steps * (k + 1) / (failures + 1)) for k in range(failures)]
    spec = ";".join(f"kill:replica={1 + k % (replicas - 1)},step={s},phase={PHASES[k % len(PHASES)]}"
                    for k, s in enumerate(at))
    return spec, at


def checkpoint_cost(cfg, reps: int) -> tuple[float, float, float]:
    """Median seconds to write one DCP checkpoint of the run's state (start to complete on disk) and
    median seconds async_save blocks the caller; and the state's GB."""
    torch.manual_seed(0)
    f = default_factories()
    model = f.model(cfg)
    opt = f.optimizer(list(model.parameters()), cfg)
    materialize(model, opt)
    state = training_state(model, opt)
    full, blocking = [], []
    with tempfile.TemporaryDirectory(prefix="goodput-ckpt-") as tmp:
        ck = Checkpointer(tmp, run_id="run-cost", world=1, every=1)
        for n in range(reps + 1):  # the first save also imports and plans DCP: dropped
            t = time.perf_counter()
            ck.save_async(n, state)
            b = time.perf_counter() - t
            ck.wait()
            if n:
                full.append(time.perf_counter() - t)
                blocking.append(b)
    gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    return statistics.median(full), statistics.median(blocking), gb


def curve(records: list[dict]) -> tuple[float, list[tuple[float, int]], list[float], dict]:
    """From one run's events: run start, (seconds since start, committed tokens) at each new frontier,
    fault times (s), and counters. Tokens of a step count once, when it first passes the frontier."""
    start = next(r["t"] for r in records if r["event"] == "run_start")
    end = next((r["t"] for r in records if r["event"] == "run_end"), max(r["t"] for r in records))
    tokens: dict[int, int] = {}
    pts: list[tuple[float, int]] = [(0.0, 0)]
    frontier, total, records_seen = -1, 0, 0
    for r in sorted((r for r in records if r["event"] == "step"), key=lambda r: r["t"]):
        records_seen += 1
        tokens[r["step"]] = r["tokens"]
        while frontier + 1 in tokens:  # redone steps below the frontier add nothing
            frontier += 1
            total += tokens[frontier]
            pts.append((r["t"] - start, total))
    faults = [r["t"] - start for r in records if r["event"] == "fault"]
    restored = [r["seconds"] for r in records if r["event"] == "restored"]
    held = replica_seconds(records, start, end)
    stats = {"wall": end - start, "tokens": total, "replica_s": held, "steps": frontier + 1,
             "step_records": records_seen,
             "restarts": sum(r["event"] == "restart" for r in records),
             "restore_s": statistics.median(restored) if restored else 0.0}
    return start, pts, faults, stats


def replica_seconds(records: list[dict], start: float, end: float) -> float:
    """Replica-seconds the run held: every replica from run start to run end, except that one the
    coordinator declared dead and that never came back (live: no restart follows) is held only until
    then. A restart relaunches every replica, so a death followed by a restart costs the whole slot."""
    replicas = next(r["replicas"] for r in records if r["event"] == "run_start")
    last_restart = max((r["t"] for r in records if r["event"] == "restart"), default=start)
    gone = {r["replica"]: r["t"] for r in records if r["event"] == "member_dead" and r["t"] >= last_restart}
    for r in records:  # a group that rejoined (live-rejoin) holds its slot again from its restart on
        if r["event"] == "join" and r["replica"] in gone:
            del gone[r["replica"]]
    return sum((gone.get(k, end) - start) for k in range(replicas))


def failure_free_step(records: list[dict], first_fault: int, skip: int = 2) -> float:
    """Median commit-to-commit interval of steps skip..first_fault-1 (no failure yet)."""
    t = {r["step"]: r["t"] for r in records if r["event"] == "step"}
    gaps = [t[s] - t[s - 1] for s in range(max(1, skip), first_fault) if s in t and s - 1 in t]
    if not gaps:
        raise SystemExit("no failure-free steps before the first kill: raise --steps")
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 24 steps: a smoke test")
    ap.add_argument("--steps", type=int, default=None, help="default 32 (24 with --quick)")
    ap.add_argument("--failures", type=int, default=None, help="successive kills (default: replicas - 1, at most 3)")
    ap.add_argument("--replicas", type=int, default=None, help="default: the number of cores (one each)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=None, help="default 4 (2 with --quick)")
    ap.add_argument("--n-embd", type=int, default=None, help="default 128 (64 with --quick)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 128 (64 with --quick)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mode, order reversed every round")
    ap.add_argument("--ckpt-reps", type=int, default=3)
    ap.add_argument("--out", default="runs/goodput")
    args = ap.parse_args()
    cores = os.cpu_count() or 2
    args.replicas = args.replicas or max(2, cores)
    args.failures = args.failures if args.failures is not None else min(3, args.replicas - 1)
    steps = args.steps or (24 if args.quick else 32)
    n_layer = args.n_layer or (2 if args.quick else 4)
    n_embd = args.n_embd or (64 if args.quick else 128)
    seq = args.seq_len or (64 if args.quick else 128)
    if not 1 <= args.failures < args.replicas:
        raise SystemExit("--failures must leave replica 0 alive: 1 .. replicas-1")
    console = Console(width=130)
    console.print(f"capacity: {args.replicas} replicas, one torch thread each, on {cores} cores; every mode is "
                  f"charged the replica-seconds it holds (restart modes: all {args.replicas} replicas, relaunched "
                  f"after each failure; live: each replica until it is declared dead)")
    if args.replicas > cores:
        console.print(f"[red]warning: {args.replicas} processes on {cores} cores: a lost replica frees no core "
                      f"until fewer than {cores} remain, so replica-seconds overstate what live gives up")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    faults, fail_steps = schedule(steps, args.failures, args.replicas)
    base = dict(replicas=args.replicas, steps=steps, microbatches=args.microbatches, launch__progress=False,
                faults__spec=faults, launch__launcher="torchrun", model__n_layer=n_layer, model__n_embd=n_embd,
                model__block_size=seq, data__batch_size=args.batch_size, data__seq_len=str(seq),
                coord__run_timeout=1200)
    with console.status("measuring the checkpoint cost of this model's state (DCP, in-process)"):
        ckpt_s, ckpt_block_s, gb = checkpoint_cost(make_config(**base), args.ckpt_reps)
    console.print(f"{args.replicas} replicas, {steps} steps x {args.microbatches} microbatches, model "
                  f"{n_layer}x{n_embd}, seq {seq}, state {gb * 1e3:.1f} MB; failures: {faults}")
    console.print(f"checkpoint cost C (measured here, DCP async_save until complete): {ckpt_s:.3f} s "
                  f"(blocking part {ckpt_block_s:.3f} s)")
    # A private shm root: cleanups of /dev/shm/unbroken/node*/run-* by concurrent runs cannot reach it
    shm = f"/dev/shm/unbroken/bench-goodput-{os.getpid()}"
    atexit.register(shutil.rmtree, shm, True)  # also when a run fails and the script exits
    snap = dict(snapshot__enabled=True, snapshot__every=1, snapshot__shm_dir=shm)
    results: dict[str, dict] = {}
    every = None
    order = [(m, rnd) for rnd in range(args.rounds) for m in (MODES if rnd % 2 == 0 else MODES[::-1])]
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    held: dict[str, list[float]] = {m: [] for m in MODES}  # replica-seconds held, per run
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # CPU seconds of all the run's processes
    step_s = 0.0  # set by the first live run, which always precedes restart-disk in round 0
    for mode, rnd in order:  # live, memory, disk, disk, memory, live, ...: load drift hits all modes alike
        extra: dict = dict(snap)
        if mode == "live-rejoin":  # each killed group restarted by its torchrun job, healed from a peer
            extra = dict(launch__restarts=args.failures)
        elif mode == "restart-disk" and every is not None:
            extra = dict(checkpoint__every=every)
        elif mode == "restart-disk":
            # Young/Daly from measured figures only: C above, MTBF from the live run's failure-free steps
            gap = fail_steps[0] if len(fail_steps) == 1 else statistics.median(
                b - a for a, b in zip([0, *fail_steps], fail_steps))
            mtbf = gap * step_s
            interval = young_daly_interval(ckpt_s, mtbf)
            every = max(1, round(interval / step_s))
            console.print(f"restart-disk: failure-free step {step_s:.3f} s (live run, before its first "
                          f"failure) x {gap:g} steps between failures = MTBF {mtbf:.1f} s; Young/Daly "
                          f"sqrt(2 C MTBF) = {interval:.2f} s -> --checkpoint.every={every} steps")
            extra = dict(checkpoint__every=every)
        run_dir = out / (mode if rnd == 0 else f"{mode}-{rnd}")
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # never resume an earlier run's files
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with console.status(f"{mode}: {steps} steps, {args.failures} failures"):
            recovery = "live" if mode == "live-rejoin" else mode
        result = launch(make_config(**base, **extra, recovery=recovery, launch__out=str(run_dir)), title=mode)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run, reaped by now
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if not result.ok:
            raise SystemExit(f"{mode} run failed: {result.error} (see {run_dir})")
        records = read_events(run_dir / "events.jsonl")
        _, _, _, stats = curve(records)
        if mode == "live" and rnd == 0:
            step_s = failure_free_step(records, fail_steps[0])
        stats["goodput"] = stats["tokens"] / stats["wall"]
        walls[mode].append(stats["wall"])
        held[mode].append(stats["replica_s"])
        cpu[mode].append(cpu_s)
        if rnd == 0:
            results[mode] = stats
        console.print(f"round {rnd + 1} {mode:>14}: {stats['tokens']} tokens in {stats['wall']:.1f} s = "
                      f"{stats['goodput']:.0f} tokens/s, {stats['restarts']} restarts, "
                      f"{stats['step_records'] - stats['steps']} steps redone")
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # disk space; the events stay
    shutil.rmtree(shm, ignore_errors=True)
    t = Table(title=f"goodput, {args.replicas} trainer processes on {os.cpu_count()} cores, "
                    f"{args.failures} kills at steps {fail_steps}", title_justify="left")
    t.title += " (round 1; pooled figures below)"
    for col in ("mode", "wall s", "tokens", "tokens/s", "replica-s held", "tokens/replica-s", "restarts",
                "steps redone", "median restore s", "vs live (per replica-s)"):
        t.add_column(col, justify="right")
    for mode, s in results.items():
        per = s["tokens"] / s["replica_s"]
        t.add_row(mode, f"{s['wall']:.1f}", str(s["tokens"]), f"{s['goodput']:.0f}", f"{s['replica_s']:.0f}",
                  f"{per:.1f}", str(s["restarts"]), str(s["step_records"] - s["steps"]), f"{s['restore_s']:.2f}",
                  f"{per / (results['live']['tokens'] / results['live']['replica_s']):.2f}")
    console.print(t)
    png = out / "goodput.png"  # `unbroken report` of the live run, round 1's restart runs beside it
    timelines = [timeline(out / m, m) for m in MODES]
    write_png(timelines[0], timelines[1:], png,
              f"live (failures marked) vs restarts: {args.replicas} replicas, kills at steps {fail_steps}; "
              f"restart-disk checkpoints every {every} steps (Young/Daly, C = {ckpt_s:.2f} s measured)")
    console.print(f"plot: {png}; runs under {out}/")
    console.print("Each restart pays process start-up (new Python processes, import torch, group formation) "
                  "and the restore: real costs of a restart strategy, included in the wall time.")
    console.print(f"ReCoVer reports {RECOVER_PAPER}x live over checkpoint-and-restart at 512 GPUs; this is a "
                  f"{args.replicas}-process CPU run on a shared machine, not that. Wall time "
                  f"{time.time() - t_start:.0f} s")
    # pooled over rounds: every run commits the same tokens, so this is tokens / mean wall time
    g = {m: len(walls[m]) * results[m]["tokens"] / sum(walls[m]) for m in MODES}
    gc = {m: len(held[m]) * results[m]["tokens"] / sum(held[m]) for m in MODES}  # per replica-second held
    console.print("pooled over " + str(args.rounds) + " rounds: " + ", ".join(
        f"{m} {g[m]:.0f} tokens/s, {gc[m]:.1f} tokens/replica-s (walls {', '.join(f'{w:.0f}' for w in walls[m])} s)"
        for m in MODES))
    console.print(f"raw tokens per wall second, not charging capacity (restart modes hold {args.replicas} "
                  f"replicas throughout, live fewer after its failures): live/memory "
                  f"{g['live'] / g['restart-memory']:.3f}, live/disk {g['live'] / g['restart-disk']:.3f}")
    console.print("CPU seconds used by all of a run's processes (trainers, coordinator, agents; what a shared "
                  "machine actually gave it): " + ", ".join(
                      f"{m} {statistics.fmean(cpu[m]):.0f} s = {results[m]['tokens'] / statistics.fmean(cpu[m]):.0f} "
                      f"tokens/CPU-s" for m in MODES))
    console.print("The ratios below leave out a spare's cost (restart modes and live-rejoin get one at once, "
                  "for free: the killed process's torchrun restarts it on the same host). live-rejoin gets its "
                  "capacity back as the restart modes do; plain live never does.")
    print(f"ratio goodput_per_replica_s_live_over_restart_memory {gc['live'] / gc['restart-memory']:.3f}")
    print(f"(beside the next figure: ReCoVer reports {RECOVER_PAPER}x at 512 GPUs; "
          f"a {args.replicas}-process CPU run is not that)")
    print(f"ratio goodput_per_replica_s_live_rejoin_over_restart_memory "
          f"{gc['live-rejoin'] / gc['restart-memory']:.3f}")
    print(f"ratio goodput_per_replica_s_live_rejoin_over_restart_disk {gc['live-rejoin'] / gc['restart-disk']:.3f}")
    print(f"ratio goodput_per_replica_s_live_over_restart_disk {gc['live'] / gc['restart-disk']:.3f}")


if __name__ == "__main__":
    main()
