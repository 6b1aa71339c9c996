"""Recovery time: from a fault to the next committed step, in failure-free step times, for a kill, a
hang and a node loss, each its own figure.

Each trial is one real run through unbroken's launcher (R replicas on gloo) with one injected fault:
  kill   `kill:replica=r,step=S,phase=P`: SIGKILL of one trainer; the launcher sees the child end
         (pidfd) and the survivors' gloo collective fails at once;
  hang   `hang:replica=r,step=S,phase=allreduce,for=F`: SIGSTOP; nothing ends and no socket closes, so
         only the coordinator's heartbeat timeout (--coord.heartbeat_timeout) finds it; the stopped
         process wakes after F s, finds itself fenced and leaves;
  node   `node:node=1,step=S`: the launcher SIGKILLs every trainer of node 1 and its snapshot agent and
         deletes its memory (in-memory snapshots on, 2 nodes, live recovery: the survivors go on).
The `fault` record is written just before the fault fires, so its `t` is the fault; the recovery point
is the first `step` record after it whose members include none of the victims (the first step
committed by the survivors alone). Failure-free step time is the median interval between consecutive
`step` records of the same run before the fault (the first --warmup dropped), so both figures share the
machine's load of that minute. Also shown, per trial: fault -> member_dead (the coordinator's new
epoch); the rest is re-forming the gloo group, redoing the lost microbatches, all-reduce and commit.

The kill target is at most one step time plus one second; a hang cannot beat its heartbeat timeout,
printed beside it. Each kind runs --repeats times (the victim rotates); the median of each kind is its
figure. A trial whose run fails (other jobs on this shared machine sometimes kill our processes) is
run once more, with a note; a second failure ends the script.
Last lines: `ratio recovery_kill VALUE`, `ratio recovery_hang VALUE`, `ratio recovery_node VALUE`
(median recovery seconds over failure-free step seconds). They leave out start-up and what a restart
would cost: the survivors never restart here.
Usage: python benchmarks/recovery.py [--repeats 2] [--replicas 4] [--fault-step 8] [--kinds kill,hang,node]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.api import make_config
from unbroken.events import read_events
from unbroken.runtime.launcher.launch import launch


@dataclass(frozen=True)
class Trial:
    kind: str  # kill | hang | node
    victims: tuple[int, ...]
    step_s: float  # failure-free step time of this run, before the fault
    recovery_s: float  # fault -> first step committed without any victim
    detect_s: float  # fault -> the last victim's member_dead (the coordinator's new epoch)
    recovered_step: int

    @property
    def ratio(self) -> float:
        return self.recovery_s / self.step_s


def spec_of(kind: str, n: int, args: argparse.Namespace) -> tuple[str, dict]:
    """The fault spec of trial n of `kind`, and the config keys it needs."""
    replica = 1 + n % (args.replicas - 1)  # rotate the victim; replica 0 always survives
    if kind == "kill":
        return f"kill:replica={replica},step={args.fault_step},phase=allreduce", {}
    if kind == "hang":
        # stopped longer than detection plus a recovery, so it wakes as a zombie and fences itself
        stop = args.heartbeat_timeout + 5
        return (f"hang:replica={replica},step={args.fault_step},phase=allreduce,for={stop:g}",
                dict(coord__heartbeat_timeout=args.heartbeat_timeout))
    return f"node:node=1,step={args.fault_step}", dict(snapshot__enabled=True, snapshot__nodes=2)


def trial(kind: str, n: int, args: argparse.Namespace, out: Path) -> Trial:
    spec, extra = spec_of(kind, n, args)
    cfg = make_config(replicas=args.replicas, steps=args.fault_step + 1 + args.after,
                      microbatches=args.microbatches, launch__progress=False, launch__out=str(out), faults__spec=spec,
                      **extra)
    result = launch(cfg, title=f"recovery {kind}")
    if not result.ok:
        raise RuntimeError(f"run with a {kind} failed: {result.error} (see {out})")
    records = read_events(out / "events.jsonl")
    fault = next(r for r in records if r["event"] == "fault")
    victims = tuple(fault["replicas"]) if kind == "node" else (fault["replica"],)
    committed = sorted((r for r in records if r["event"] == "step"), key=lambda r: r["t"])
    before = [r["t"] for r in committed if r["t"] < fault["t"]]
    gaps = [b - a for a, b in zip(before, before[1:])][args.warmup:]
    recovered = next((r for r in committed if r["t"] > fault["t"] and not set(victims) & set(r["members"])), None)
    if recovered is None or not gaps:
        after = [(r["step"], r["members"]) for r in committed if r["t"] > fault["t"]]
        raise RuntimeError(f"no step committed without {victims} after the {kind}: {after} (see {out})")
    dead = [r["t"] for r in records if r["event"] == "member_dead" and r["replica"] in victims]
    return Trial(kind, victims, statistics.median(gaps), recovered["t"] - fault["t"], max(dead) - fault["t"],
                 recovered["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="trials of each kind")
    ap.add_argument("--kinds", default="kill,hang,node", help="comma-separated: kill, hang, node")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--fault-step", type=int, default=8, help="step of the fault (steps before it give the step time)")
    ap.add_argument("--after", type=int, default=1, help="steps after the fault step")
    ap.add_argument("--warmup", type=int, default=2, help="step intervals dropped at the start of each run")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0, help="s; the hang's detection time")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if args.fault_step - 1 <= args.warmup:
        ap.error("--fault-step must leave failure-free step intervals after --warmup")
    if unknown := set(kinds) - {"kill", "hang", "node"}:
        ap.error(f"unknown kind {sorted(unknown)[0]!r}")
    if "node" in kinds and args.replicas % 2:
        ap.error("a node loss needs an even --replicas (2 nodes)")
    console = Console(width=120)
    t_start = time.time()
    trials: list[Trial] = []
    tmp = tempfile.mkdtemp(prefix="recovery-")  # removed on success; kept to read when a run fails
    plan = [(kind, n) for n in range(args.repeats) for kind in kinds]  # kinds interleaved: same load drift
    for k, (kind, n) in enumerate(plan):
        with console.status(f"trial {k + 1}/{len(plan)}: {spec_of(kind, n, args)[0]}"):
            try:
                tr = trial(kind, n, args, Path(tmp) / f"{kind}-{n}")
            except RuntimeError as e:
                console.print(f"[yellow]trial {k + 1} failed, run once more: {e}")
                tr = trial(kind, n, args, Path(tmp) / f"{kind}-{n}-again")
        trials.append(tr)
        console.print(f"trial {k + 1}: {kind:>4} {tr.victims}: recovery {1e3 * tr.recovery_s:.0f} ms, "
                      f"step {1e3 * tr.step_s:.0f} ms, ratio {tr.ratio:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    t = Table(title=f"fault -> next committed step without the victims, {args.replicas} replicas, "
                    f"{args.microbatches} microbatches/step", title_justify="left")
    for col in ("kind", "victims", "step ms", "member_dead ms", "recovery ms", "recovered step", "x step time"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for tr in trials:
        t.add_row(tr.kind, str(list(tr.victims)), f"{1e3 * tr.step_s:.0f}", f"{1e3 * tr.detect_s:.0f}",
                  f"{1e3 * tr.recovery_s:.0f}", str(tr.recovered_step), f"{tr.ratio:.2f}")
    console.print(t)
    console.print(f"wall time {time.time() - t_start:.0f} s. Bounds: a kill, 1 step + 1 s; a hang, its heartbeat "
                  f"timeout ({args.heartbeat_timeout:g} s) + 1 step + 1 s.")
    for kind in kinds:
        ts = [tr for tr in trials if tr.kind == kind]
        step = statistics.median(tr.step_s for tr in ts)
        bound = step + 1.0 + (args.heartbeat_timeout if kind == "hang" else 0.0)
        print(f"{kind}: median step {1e3 * step:.0f} ms, bound {bound / step:.2f} step times; "
              f"median recovery {1e3 * statistics.median(tr.recovery_s for tr in ts):.0f} ms")
    for kind in kinds:
        print(f"ratio recovery_{kind} {statistics.median(tr.ratio for tr in trials if tr.kind == kind):.2f}")


if __name__ == "__main__":
    main()
