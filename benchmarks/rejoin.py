"""Rejoin: a replica group SIGKILLed, restarted by torchrun, admitted and healed from a live peer.

One real run through unbroken's launcher: R groups of G ranks, each group a torchrun job with
`--max-restarts=1` (`--launch.restarts=1`); `kill:replica=1,rank=G-1,step=S` SIGKILLs one rank of group 1.
torchrun tears the group down and restarts it; the coordinator declares the old group dead (at once when
the group's surviving rank saw its process group break and reported it, else after the heartbeat timeout:
torchrun's agent does not exit, so no launcher report), the survivors redo its microbatches and
go on; the restarted group asks to join, is admitted in a new epoch at a step boundary, each of its
ranks takes the state of the donor's rank of the same index, and it takes quotas again.

From the run's events:
  back      seconds from the `fault` record to the first committed step whose members include group 1;
  longest   the survivors' longest step interval (between consecutive `step` records) from the group's
            admission (`join`) until it is back: what the heal (the donor holds its next step up until
            the heal group has formed and the transfer is done) and the joiner's first step cost them
            (the admission itself no longer re-reduces the step in flight), in failure-free
            step times (median interval before the fault, first --warmup dropped). Target <= 2. Beside
            it, over the survivors' own steps before the admission (they carry the lost group's quota).
            Shown apart: the step the fault hit (it lasts the heartbeat timeout) and the longest step of
            the whole outage, which on this machine includes the restarted processes importing torch on
            the survivors' 2 cores (on a cluster the replacement starts on a host of its own).
  heal      bytes a joiner rank received over its transfer seconds (the `heal` records), against a
            memcpy of the same bytes on this machine (median of 20 torch copies); the transfer alone (the
            `transfer` field: broadcasts after a barrier), the group's rendezvous shown apart.

  link      the same bytes sent once more right after each heal, between the same two processes over
            the same gloo group, as one plain torch.distributed send/recv (benchmarks/_healprobe.py, put
            into the workers through a sitecustomize): `ratio heal_over_link` is the joiner's heal
            bandwidth (its transfer: the barrier until the last bucket is in its tensors) over the
            link's, median over the group's ranks. The probe holds the donor's step up once more.
  kill-to-back, split: torchrun's restart (the kill to the restarted process's start, from /proc in
            its `worker_start`: `born`), its imports and set-up (to `worker_start`), admission (to the
            coordinator's `join`), heal (to the joiner's last `heal` record: waiting for the donor's step
            boundary, rendezvous, transfer), and its first step (to the first committed step with it).

Last line: `ratio rejoin_longest_step VALUE`. With `--runs N` (N fresh launches, one after another), each
run's figures, then the medians of the ratios over the runs, the worst run's, and `ratio
rejoin_within_2_steps K/N`: the share of runs whose survivors' longest step stayed within 2 failure-free
steps (a run whose group was not back by its last step counts as outside). What it leaves out: the restarted processes' start-up
(imports, torchrun's agent: in `back`, not in `longest`), and a cluster's network: here the transfer
is over loopback between processes that share 2 cores.
Usage: python benchmarks/rejoin.py [--replicas 3] [--group-size 2] [--steps 120] [--fault-step 10]
       [--n-layer L] [--n-embd E] [--runs N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from unbroken.api import make_config
from unbroken.events import read_events
from unbroken.runtime.launcher.launch import launch


def memcpy_seconds(nbytes: int, repeats: int = 20) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # fault the pages in once
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--microbatches", type=int, default=6)
    ap.add_argument("--fault-step", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=None, help="the GPT's blocks (default: the config's)")
    ap.add_argument("--n-embd", type=int, default=None, help="its width: a wider model heals more bytes a rank")
    ap.add_argument("--runs", type=int, default=1, help="fresh launches, one after another; the count of runs "
                    "whose survivors' longest step stayed within 2 failure-free steps is printed")
    args = ap.parse_args()
    console = Console(width=120)
    probes = install_probe(Path(tempfile.mkdtemp(prefix="rejoin-probe-")))
    figures: list[dict[str, float]] = []
    failed: list[str] = []
    for k in range(args.runs):
        if args.runs > 1:
            console.rule(f"run {k + 1} of {args.runs}")
        for old in probes.glob("probe-*.jsonl"):
            old.unlink()  # each run's link figure from its own probes
        try:
            figures.append(measure(args, console, probes))
        except RunFailed as e:
            failed.append(str(e))
            console.print(f"[red]run {k + 1}: {e}[/red]")
    if args.runs == 1 and failed:
        raise SystemExit(failed[0])
    if args.runs > 1:
        summarize(figures, failed, args.runs, console)


class RunFailed(Exception):
    """One launch whose rejoin cannot be measured: the run failed, or the group was not back by its end."""


def measure(args: argparse.Namespace, console: Console, probes: Path) -> dict[str, float]:
    """One launch with one rank of group 1 killed; prints its figures and returns its ratios.
    Raises RunFailed where the run failed or group 1 was not back in a committed step by the last."""
    out = Path(tempfile.mkdtemp(prefix="rejoin-")) / "run"
    G = args.group_size
    cfg = make_config(replicas=args.replicas, steps=args.steps, microbatches=args.microbatches, launch__progress=False,
                      launch__out=str(out), parallel__group_size=G, launch__restarts=1, launch__launcher="torchrun",
                      faults__spec=f"kill:replica=1,rank={G - 1},step={args.fault_step},phase=compute",
                      coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1,
                      model__n_layer=args.n_layer, model__n_embd=args.n_embd)  # None: the config's
    with console.status(f"{args.replicas} groups x {G} ranks, {args.steps} steps, a rank of group 1 killed"):
        result = launch(cfg)
    if not result.ok:
        raise RunFailed(f"the run failed: {result.error} (run dir {out})")
    events = read_events(out)
    fault = next((e for e in events if e["event"] == "fault"), None)
    dead = next((e for e in events if e["event"] == "member_dead" and e["replica"] == 1), None)
    if fault is None or dead is None:
        raise RunFailed(f"the kill {'did not fire' if fault is None else 'fired, but group 1 was not declared dead'}"
                        f" (run dir {out})")
    records = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"])
    # the step the fault hit and later ones: a step before it may be recorded just after the kill (its
    # writer steps ahead), with group 1 among its members
    back = next((e for e in records if e["step"] >= fault["step"] and e["t"] > fault["t"] and 1 in e["members"]),
                None)
    if back is None:
        raise RunFailed(f"group 1 was not back in a committed step by step {args.steps - 1} (run dir {out})")
    before = [b["t"] - a["t"] for a, b in zip(records, records[1:]) if b["step"] <= args.fault_step][args.warmup:]
    step_s = statistics.median(before)
    join = next(e for e in events if e["event"] == "join" and e["replica"] == 1)
    # interval ending at each record; the first record after member_dead is the step the fault hit
    gaps = [(b["t"] - a["t"], b) for a, b in zip(records, records[1:])]
    after = [(g, r) for g, r in gaps if dead["t"] < r["t"] <= back["t"] and r["step"] >= fault["step"]]
    hit = after[0][0]
    outage = max((g for g, _ in after[1:]), default=0.0)
    alone = [g for g, r in after[3:] if r["t"] < join["t"]]  # survivors' steps, settled, before the admission
    around = [g for g, r in after if r["t"] > join["t"]]
    longest = max(around, default=0.0)
    heals = [e for e in events if e["event"] == "heal" and e["side"] == "joiner"]
    if not heals:
        raise RunFailed(f"group 1 came back without a heal record (run dir {out})")
    nbytes = heals[0]["bytes"]
    heal_bw = statistics.median(e["bytes"] / e["transfer"] for e in heals)
    formation = statistics.median(e["seconds"] - e["transfer"] for e in heals)
    copy_bw = nbytes / memcpy_seconds(nbytes)
    model = f"GPT {cfg.model.n_layer} x {cfg.model.n_embd}"
    console.print(f"configuration: {args.replicas} groups x {G} ranks (FSDP2 inside), {model}, "
                  f"{args.microbatches} microbatches/step, torchrun --max-restarts=1, heartbeat timeout 2 s")
    console.print(f"failure-free step {1e3 * step_s:.1f} ms (median of {len(before)} intervals before the fault)")
    console.print(f"kill -> member_dead {dead['t'] - fault['t']:.2f} s; kill -> group back in a committed step "
                  f"{back['t'] - fault['t']:.2f} s (step {back['step']}; restart, imports, admission, heal)")
    console.print(f"the step the fault hit: {hit:.2f} s ({hit / step_s:.1f} failure-free steps: the heartbeat timeout)")
    own = (f"; over the survivors' own steps before it ({1e3 * statistics.median(alone):.1f} ms): "
           f"{longest / statistics.median(alone):.2f}") if alone else ""
    console.print(f"survivors' longest step from the admission until the group is back: {1e3 * longest:.1f} ms = "
                  f"{longest / step_s:.2f} failure-free steps ({len(around)} steps){own}")
    console.print(f"longest step of the whole outage (after the step the fault hit): {outage / step_s:.2f} "
                  f"failure-free steps (the restarted processes start up on the same 2 cores here)")
    console.print(f"heal: the two-rank group's rendezvous {1e3 * formation:.1f} ms, then "
                  f"{nbytes / 1e6:.2f} MB a rank at {heal_bw / 1e9:.3f} GB/s against memcpy "
                  f"{copy_bw / 1e9:.2f} GB/s: {heal_bw / copy_bw:.3f} of memcpy")
    split = kill_to_back(events, fault, back)
    console.print("kill -> back split: " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()))
    link = [json.loads(line) for p in probes.glob("probe-*.jsonl") for line in p.read_text().splitlines()]
    link_bw = statistics.median(e["bytes"] / e["seconds"] for e in link if e["side"] == "joiner")
    console.print(f"link: the same bytes as one plain send/recv between the same processes: "
                  f"{link_bw / 1e9:.3f} GB/s (median of {len(link) // 2} ranks); heal {heal_bw / 1e9:.3f} GB/s")
    figures = {"heal_over_link": heal_bw / link_bw, "rejoin_back_seconds": back["t"] - fault["t"],
               "heal_over_memcpy": heal_bw / copy_bw, "rejoin_longest_step": longest / step_s}
    for name, value in figures.items():
        print(f"ratio {name} {value:.4f}" if name == "heal_over_memcpy" else f"ratio {name} {value:.3f}")
    return figures


def summarize(figures: list[dict[str, float]], failed: list[str], runs: int, console: Console) -> None:
    """The figures over `runs` launches: each ratio's median and worst, and the count within 2 steps."""
    console.rule(f"{runs} runs, {len(failed)} not measurable")
    for reason in failed:
        console.print(f"not measurable: {reason}")
    if figures:
        longest = [f["rejoin_longest_step"] for f in figures]
        link = [f["heal_over_link"] for f in figures]
        console.print("survivors' longest step, failure-free steps, each run: " + " ".join(f"{x:.2f}" for x in longest))
        console.print("heal over link, each run: " + " ".join(f"{x:.3f}" for x in link))
        print(f"ratio heal_over_link_median {statistics.median(link):.3f} (lowest {min(link):.3f})")
        print(f"ratio rejoin_longest_step_median {statistics.median(longest):.2f} (highest {max(longest):.2f})")
    within = sum(f["rejoin_longest_step"] <= 2.0 for f in figures)
    print(f"ratio rejoin_within_2_steps {within}/{runs} = {within / runs:.2f}")


def install_probe(tmp: Path) -> Path:
    """Put _healprobe into every process the launches start (a sitecustomize on PYTHONPATH); returns
    the folder its records go to. Call once per process."""
    site, probes = tmp / "site", tmp / "probes"
    site.mkdir()
    probes.mkdir()
    here = str(Path(__file__).resolve().parent)
    site.joinpath("sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {here!r})\nimport _healprobe\n_healprobe.install({str(probes)!r})\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, here)
    return probes


def kill_to_back(events: list[dict], fault: dict, back: dict) -> dict[str, float]:
    """Seconds of each part of the kill -> back interval of group 1 (see the docstring)."""
    starts = [e for e in events if e["event"] == "worker_start" and e["replica"] == 1 and e["t"] > fault["t"]]
    born = min(e["born"] for e in starts)
    up = max(e["t"] for e in starts)
    join = next(e for e in events if e["event"] == "join" and e["replica"] == 1 and e["t"] > fault["t"])
    healed = max(e["t"] for e in events if e["event"] == "heal" and e["side"] == "joiner")
    return {"torchrun restart": born - fault["t"], "imports and set-up": up - born, "admission": join["t"] - up,
            "heal": healed - join["t"], "first step": back["t"] - healed}


if __name__ == "__main__":
    main()
