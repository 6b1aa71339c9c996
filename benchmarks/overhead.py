"""Failure-free overhead: unbroken's steady-state step time against plain DistributedDataParallel.

Both sides do the same work (see benchmarks/_ddp_baseline.py): the same GPT, the same microbatches, M of
them a step split evenly across R real processes on gloo, one torch thread each, AdamW. unbroken runs
through its own CLI and launcher (coordinator, heartbeats, store protocol, copy-then-reduce, digests,
events) with `run.quotas=equal` (M/R microbatches per replica, DDP's split); the baseline is DDP with
`no_sync()` accumulation. Step times come from each side's own clock records: unbroken's `step`
records, and the baseline's rank 0, which appends its wall clock after each optimizer step.

How: time-sliced, side by side. This machine is shared, and its speed drifts by more than the 3% this
figure must resolve: the same DDP configuration ran at 68-117 ms a step in runs a minute apart, and
neighbouring runs of an earlier version of this benchmark (separate 25-step runs in ABBA order)
disagreed by up to 1.5x. So both sides run at once, each one long run, and take turns: while one runs
for a --window of seconds, every process of the other (launcher, coordinator and trainers; or the DDP
ranks) is frozen with SIGSTOP, then they swap (SIGCONT). Both see the machine of the same few seconds.
A window's figure is the median of the step intervals wholly inside it, after the first --settle ones
(a thawed run refills its caches; a step frozen half way is not a step). Each round has one window of
each side, in ABBA order; a round's ratio is its unbroken window over its DDP window. The figure is the
median of the rounds' ratios, with a 95% bootstrap interval over rounds (how tightly one run pins it
down) and the pooled ratio of all intervals. Heartbeat, progress and collective timeouts are raised for
the runs: a frozen coordinator must not count its own sleep as its members' silence, nor gloo a
collective frozen half way as a peer's (DDP's default is 30 minutes).

Extras (--extras, a comma list; one window each per round, each against the same round's DDP window):
`exact` (float64 accumulation and reduction), `speed` (the default speed-weighted quotas, which move
microbatches to whichever replica the machine favours), `no-pipelining` (run.step_ahead=off: every
member waits for the commit decision before its optimizer step, the protocol without its pipelining).

Prints a table; the CPU ms a step of every side by role (benchmarks/_cpu.py: trainers' main threads,
gloo's threads, unbroken's helper threads, the control plane), and a `breakdown <side> - ddp` line of
the differences: where the overhead goes, with `ratio overhead_trainer_cpu` (the trainer processes,
every thread) and `ratio overhead_total_cpu` (every process), which a loaded host moves far less than
the wall-clock ratio; each side's peak resident memory per trainer and its
`ratio peak_memory[_<extra>]` against DDP's; the extras' `ratio overhead <name> <value>` lines, and last
`ratio overhead <unbroken / DDP>` for the default float32 mode with equal quotas (target <= 1.03).

Which configuration: by default one trainer process per core (--replicas: 1, 2 or 4, whichever is the
most that fits), as on a GPU node, where each trainer drives a device of its own and the host has cores
to spare for the coordinator, the launcher and each member's helper threads (heartbeat, store
sidecar, decision watch). With more trainers than cores (--replicas 4 on 2 cores) every millisecond of
that CPU is taken from the training itself, and the figure is the control plane's CPU share instead.

Measured on the 2-core development machine, 8 microbatches, GPT 2 x 64 (0.1M parameters), median of
the rounds' ratios (95% bootstrap interval), pooled ratio; one run each:
  2 replicas (the default here), 16 rounds   1.006 (0.977-1.021)  pooled 1.010   exact 1.040, speed 0.981
  2 replicas, 24 rounds, same code           1.010 (0.990-1.043)  pooled 1.030
  2 replicas, code before the sidecar publish (12 rounds)  1.027 (1.014-1.043)
  4 replicas on 2 cores, 16 rounds           1.059 (1.044-1.082)  pooled 1.067
  4 replicas, earlier days: 1.08-1.11 (2 x 64); 0.99 and 1.04 (4 x 128); 1.04 (4 x 192, --window 5)
Where 4 replicas' gap goes (per-thread CPU from /proc, time-sliced as here, 10 rounds of 3 s; ms of
CPU a step summed over processes): DDP 87.3, unbroken 94.4. Of the +7.1: members' main threads +3.2
(policy, events, the rollback copy ~0.09 ms a member, and more cache and scheduler churn beside more
threads), their store sidecars 1.4 (done counts, the commit compare-and-set, one member's step record
with its sha256, ~0.26 ms), the coordinator 1.2 (store server 0.85), decision watches 0.4, gloo +0.6,
the launcher 0.2. With 2 replicas the same accounting gave main threads 65.7 against DDP's 66.2 and
~2 ms a step of helpers and coordinator beside the trainers' ~66 ms. What grows with the model (the
sha256 and an xxh3 a member, the copy that is reduced) is a few ms per million parameters.
Usage: python benchmarks/overhead.py [--rounds 16] [--window 3] [--settle 3] [--replicas N]
       [--microbatches 8] [--n-layer 2] [--n-embd 64] [--extras exact,speed]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _ddp_baseline when run from anywhere
import _cpu  # noqa: E402
import _ddp_baseline  # noqa: E402

from unbroken.api import make_config  # noqa: E402
from unbroken.runtime.launcher.processes import process_tree  # noqa: E402
from unbroken.events import read_events  # noqa: E402

LONG = 10 ** 6  # steps of each run: it is stopped when the rounds are done
EXTRAS = {"exact": ["--run.quotas=equal", "--exact"], "speed": ["--run.quotas=speed"],
          "no-pipelining": ["--run.quotas=equal", "--run.step_ahead=off"]}


class Side:
    """One long run of one system, frozen and thawed as a whole; `times()` are its step-end times."""

    def __init__(self, name: str, procs: list[subprocess.Popen], times):
        self.name, self.procs, self.times = name, procs, times
        self.windows: list[tuple[float, float]] = []  # (thawed at, frozen at), time.time()
        self.cpu: list[dict[tuple[int, int], float]] = []  # per window: (pid, tid) -> CPU s it ran (_cpu.py)

    def pids(self) -> list[int]:
        """Every live process of the run: the started ones and their descendants."""
        return [pid for p in self.procs for pid in process_tree(p.pid)]

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def check(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{self.name}: a process ended with code {p.returncode}")

    def wait_steps(self, n: int, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        while len(self.times()) < n:
            self.check()
            if time.time() > deadline:
                raise RuntimeError(f"{self.name}: fewer than {n} steps after {timeout_s:.0f} s")
            time.sleep(0.2)

    def run_window(self, seconds: float) -> None:
        pids = self.pids()
        before = _cpu.snapshot(pids)  # frozen: nothing runs between this read and the thaw
        self.signal(signal.SIGCONT)
        t0 = time.time()
        time.sleep(seconds)
        self.signal(signal.SIGSTOP)
        self.windows.append((t0, time.time()))
        self.cpu.append(_cpu.spent(before, _cpu.snapshot(pids)))
        self.check()

    def window_intervals(self, settle: int) -> list[list[float]]:
        """Per window, the intervals between consecutive step ends wholly inside it, the first `settle`
        dropped."""
        times = sorted(self.times())
        out = []
        for a, b in self.windows:
            inside = [t for t in times if a <= t <= b]
            out.append([y - x for x, y in zip(inside, inside[1:])][settle:])
        return out

    def stop(self) -> None:
        tree = self.pids()  # now: a torchrun worker whose agent dies first is re-parented, out of reach
        self.signal(signal.SIGCONT)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # unbroken's launcher kills its children on SIGTERM
        deadline = time.time() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_unbroken(name: str, out: Path, args: argparse.Namespace, *extra: str) -> Side:
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--replicas", str(args.replicas), "--steps", str(LONG),
           "--microbatches", str(args.microbatches), f"--model.n_layer={args.n_layer}",
           f"--model.n_embd={args.n_embd}", "--launch.progress=false", "--coord.heartbeat_timeout=3600",
           "--coord.progress_timeout=3600", "--coord.collective_timeout=3600", "--coord.run_timeout=86400",
           "--parallel.device=cpu", "--out", str(out), *optim_flags(args), *extra]  # on the CPU, as the gloo baselines
    log = open(out.parent / f"{out.name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    events = out / "events.jsonl"

    def times() -> list[float]:
        if not events.exists():
            return []
        return [r["t"] for r in read_events(events) if r["event"] == "step"]
    return Side(name, [proc], times)


def start_baseline(name: str, start, cfg, path: Path) -> Side:
    """A plain-torch baseline side: `start(cfg, port, path)` launches its ranks, rank 0 appending its
    wall clock after each step to `path` (whole lines only are read: the last may be mid-write)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def times() -> list[float]:
        if not path.exists():
            return []
        text = path.read_text()
        return [float(x) for x in text[:text.rfind("\n") + 1].split()]
    return Side(name, start(cfg, port, path), times)


# --optim full: a pre-training run's optimizer step on both sides (warmup + cosine, clipping by the global norm)
OPTIM = {"full": {"schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1, "max_grad_norm": 1.0}}


def optim_flags(args: argparse.Namespace) -> list[str]:
    return [f"--optim.{k}={v}" for k, v in OPTIM.get(getattr(args, "optim", "plain"), {}).items()]


def start_ddp(tmp: Path, args: argparse.Namespace) -> Side:
    cfg = make_config(replicas=args.replicas, steps=LONG, microbatches=args.microbatches, launch__progress=False,
                      model__n_layer=args.n_layer, model__n_embd=args.n_embd,
                      **{f"optim__{k}": v for k, v in OPTIM.get(args.optim, {}).items()})
    return start_baseline("ddp", _ddp_baseline.start, cfg, tmp / "ddp-times.txt")


def parts(out: Path, settle: int) -> dict[str, float]:
    """unbroken's step per replica, split (medians over every replica and step after `settle`): its
    forward/backward, its all-reduce (which includes waiting for the slowest peer), and the rest (data,
    the store protocol, optimizer, digest, events); `waited`: the part of the rest spent waiting for a
    peer's commit decision (with commit pipelining, the decision is usually there when it is needed)."""
    applied, waited, compute, reduce = {}, {}, {}, {}
    for r in read_events(out / "events.jsonl"):
        key = (r.get("replica"), r.get("step"))
        if r["event"] == "applied":
            applied[key], waited[key] = r["t"], r["waited"]
        elif r["event"] == "compute":
            compute[key] = compute.get(key, 0.0) + r["seconds"]
        elif r["event"] == "reduce" and r["ok"]:
            reduce[key] = reduce.get(key, 0.0) + r["seconds"]
    got: dict[str, list[float]] = {"compute": [], "reduce": [], "rest": [], "waited": []}
    for (rep, s), t in applied.items():
        if s > settle and (rep, s - 1) in applied:
            interval = t - applied[(rep, s - 1)]
            got["compute"].append(compute.get((rep, s), 0.0))
            got["reduce"].append(reduce.get((rep, s), 0.0))
            got["rest"].append(interval - got["compute"][-1] - got["reduce"][-1])
            got["waited"].append(waited[(rep, s)])
    return {k: 1e3 * statistics.median(v) for k, v in got.items() if v}


def worker_pids(out: Path) -> set[int]:
    """The trainer processes of an unbroken run: each rank's `worker_start` record names its pid."""
    return {r["pid"] for r in read_events(out / "events.jsonl") if r["event"] == "worker_start"}


def cpu_per_step(side: Side, trainers: set[int]) -> dict[str, float]:
    """CPU seconds a step by role (_cpu.by_role) over all of `side`'s windows: their CPU over the steps
    that ended inside them."""
    times = sorted(side.times())
    steps = sum(sum(1 for t in times if a <= t <= b) for a, b in side.windows)
    total = dict.fromkeys(_cpu.ROLES, 0.0)
    for used in side.cpu:
        for k, v in _cpu.by_role(used, trainers).items():
            total[k] += v
    return {k: v / max(1, steps) for k, v in total.items()}


def peak_mib(pids: set[int]) -> list[float]:
    """Each live process's peak resident memory so far (VmHWM of /proc/<pid>/status), MiB."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                out += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")]
        except OSError:
            continue
    return out


def cpu_table(console: Console, cpu: dict[str, dict[str, float]]) -> None:
    """The CPU table by role and side (ms a step summed over processes); hsdp_overhead.py prints it too."""
    c = Table(title="CPU ms a step, summed over processes (every window; /proc, benchmarks/_cpu.py)",
              title_justify="left")
    for col in ("system", *_cpu.ROLES, "total"):
        c.add_column(col, justify="left" if col == "system" else "right")
    for name, v in cpu.items():
        c.add_row(name, *(f"{1e3 * v[k]:.1f}" for k in _cpu.ROLES), f"{1e3 * sum(v.values()):.1f}")
    console.print(c)


def cpu_breakdown(console: Console, cpu: dict[str, dict[str, float]]) -> None:
    """The CPU table by role and side, then one `breakdown` line: where unbroken's extra CPU a step goes
    against DDP, role by role (ms a step summed over processes)."""
    cpu_table(console, cpu)
    trainer = {n: sum(v[k] for k in _cpu.ROLES if k != "control") for n, v in cpu.items()}
    for name in [n for n in cpu if n != "ddp"]:
        diff = {k: 1e3 * (cpu[name][k] - cpu["ddp"][k]) for k in _cpu.ROLES}
        print(f"breakdown {name.replace(' ', '_')} - ddp, CPU ms a step: " +
              ", ".join(f"{k} {v:+.1f}" for k, v in diff.items()) + f", total {sum(diff.values()):+.1f}")
        suffix = "" if name == "unbroken" else "_" + name.removeprefix("unbroken ").replace(" ", "_")
        # CPU a step does not drift with the host's load as wall time does: the figure a loaded host gives
        print(f"ratio overhead_trainer_cpu{suffix} {trainer[name] / trainer['ddp']:.3f}")
        print(f"ratio overhead_total_cpu{suffix} {sum(cpu[name].values()) / sum(cpu['ddp'].values()):.3f}")


def bootstrap_ci(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of `ratios` (rounds resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def default_replicas() -> int:
    """One trainer process per core, as a GPU node gives each trainer a device and host cores of its
    own (1, 2 or 4, so that the default 8 microbatches split evenly)."""
    cores = len(os.sched_getaffinity(0))
    return max(r for r in (1, 2, 4) if r <= cores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16, help="windows of each side")
    ap.add_argument("--window", type=float, default=3.0, help="s a side runs while the others are frozen")
    ap.add_argument("--settle", type=int, default=3, help="step intervals dropped after each thaw")
    ap.add_argument("--replicas", type=int, default=default_replicas(),
                    help="processes a side (default: one per core, 1, 2 or 4; see the docstring)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--extras", default="exact,speed", help=f"extra unbroken sides, of {','.join(EXTRAS)}")
    ap.add_argument("--optim", choices=["plain", "full"], default="plain",
                    help="plain: AdamW at a constant lr; full: warmup + cosine and clipping on both sides")
    args = ap.parse_args()
    names = [x for x in args.extras.split(",") if x]
    if bad := [x for x in names if x not in EXTRAS]:
        ap.error(f"--extras: unknown {bad[0]!r} (choose from {', '.join(EXTRAS)})")
    console = Console(width=120)
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))  # removed on success; kept to read when a run fails
    extras = [(f"unbroken {x}", EXTRAS[x]) for x in names]
    sides: list[Side] = []
    try:
        # Start each side and freeze it once it is past start-up (imports, first steps), one at a time.
        for name, extra in [("unbroken", ["--run.quotas=equal"]), ("ddp", None), *extras]:
            with console.status(f"starting {name}"):
                side = start_ddp(tmp, args) if extra is None else \
                    start_unbroken(name, tmp / name.replace(" ", "-"), args, *extra)
                sides.append(side)
                side.wait_steps(args.settle + 2)
                side.signal(signal.SIGSTOP)
        unb, ddp, more = sides[0], sides[1], sides[2:]
        for rnd in range(args.rounds):
            pair = [unb, ddp] if rnd % 2 == 0 else [ddp, unb]  # ABBA: a drift within two rounds cancels
            for side in pair + more:
                with console.status(f"round {rnd + 1}/{args.rounds}: {side.name}"):
                    side.run_window(args.window)
        trainers = {s.name: {p.pid for p in s.procs} if s is ddp else worker_pids(tmp / s.name.replace(" ", "-"))
                    for s in sides}
        peaks = {name: peak_mib(pids) for name, pids in trainers.items()}  # before the processes end
    finally:
        for side in sides:
            side.stop()

    per = {s.name: s.window_intervals(args.settle) for s in sides}
    # a round counts only if every side's window in it held a measured interval (a loaded host can stall
    # a window's steps); the rounds dropped are said, and none left is an error
    kept = [r for r in range(args.rounds) if all(per[s.name][r] for s in sides)]
    if not kept:
        raise RuntimeError(f"no round's windows all held {args.settle + 2} steps: raise --window (runs in {tmp})")
    if len(kept) < args.rounds:
        console.print(f"[yellow]{args.rounds - len(kept)} of {args.rounds} rounds dropped: a window in each held "
                      f"fewer than {args.settle + 2} steps")
    per = {n: [ws[r] for r in kept] for n, ws in per.items()}
    med = {n: [statistics.median(w) for w in ws] for n, ws in per.items()}
    pooled = {n: statistics.median([x for w in ws for x in w]) for n, ws in per.items()}
    cores = len(os.sched_getaffinity(0))
    t = Table(title=f"failure-free step time: {args.replicas} processes on {cores} cores, "
                    f"{args.microbatches} microbatches/step, "
                    f"{args.rounds} rounds of {args.window:g} s windows, time-sliced", title_justify="left")
    for col in ("system", "median step ms", "per-window medians ms", "intervals", "vs DDP (rounds)"):
        t.add_column(col, justify="left" if col == "system" else "right")
    ratios = {n: [a / b for a, b in zip(m, med["ddp"])] for n, m in med.items()}
    for s in sides:
        t.add_row(s.name, f"{1e3 * pooled[s.name]:.1f}", " ".join(f"{1e3 * x:.0f}" for x in med[s.name]),
                  str(sum(len(w) for w in per[s.name])), f"{statistics.median(ratios[s.name]):.3f}")
    console.print(t)
    console.print("unbroken / DDP by round: " + " ".join(f"{x:.3f}" for x in ratios["unbroken"]))
    m = parts(tmp / "unbroken", args.settle)
    console.print(f"unbroken, per replica and step (medians): forward/backward {m['compute']:.1f} ms, all-reduce "
                  f"incl. waiting for peers {m['reduce']:.1f} ms, rest (data, store protocol, optimizer, digest, "
                  f"events) {m['rest']:.1f} ms, of which waiting for a commit decision {m['waited']:.2f} ms")
    cpu_breakdown(console, {s.name: cpu_per_step(s, trainers[s.name]) for s in sides})
    console.print("peak resident memory per trainer (VmHWM), MiB: " +
                  ", ".join(f"{n} {statistics.median(v):.0f}" for n, v in peaks.items()))
    lo, hi = bootstrap_ci(ratios["unbroken"])
    console.print(f"pooled intervals: unbroken / DDP {pooled['unbroken'] / pooled['ddp']:.3f}; median of rounds "
                  f"{statistics.median(ratios['unbroken']):.3f} (95% bootstrap interval {lo:.3f}-{hi:.3f})")
    console.print(f"wall time {time.time() - t_start:.0f} s")
    shutil.rmtree(tmp, ignore_errors=True)
    for s in sides:
        if s is not ddp:
            name = "" if s is unb else f"_{s.name.removeprefix('unbroken ')}"
            print(f"ratio peak_memory{name} {statistics.median(peaks[s.name]) / statistics.median(peaks['ddp']):.3f}")
    for s in more:
        print(f"ratio overhead {s.name.removeprefix('unbroken ')} "
              f"{statistics.median(ratios[s.name]):.3f}")
    print(f"ratio overhead {statistics.median(ratios['unbroken']):.3f}")


if __name__ == "__main__":
    main()
