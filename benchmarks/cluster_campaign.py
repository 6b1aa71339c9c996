"""A fault campaign on hosts made of Linux namespaces: random schedules of host loss, partitions, cuts
between hosts, rank kills and hangs, each run judged for hangs, crashes and divergence from the
failure-free digests.

Hosts as in tests/cluster/ (needs root): the coordinator on host 0, group g's forkrun job on host g+1
(docs/cluster.md's lines, one per group, `--max-restarts=1`), `--run.exact=true`. Each run draws 1 to 3 faults
from the `--faults` grammar: host and network faults (`host`, `partition`, `cut`: injected by
tests/cluster/chaos.py) and process faults (`kill`, `hang`: by the trainers), on steps 2 .. steps/2. Group 0
is faulted only alone, so a survivor always exists (a run that loses every group at once fails by design,
and is not what this counts: a first campaign that let that happen met it in its 5th run).

Per run: hang (the coordinator did not end within --timeout s), crash (it ended non-zero), divergence (a
committed step's digest differs from the failure-free run's, or a step is missing). Last lines: the counts,
and `ratio campaign_clean_runs K/N`. What it leaves out: groups of several ranks (each group is one rank
here), the snapshot agents (no restart-memory: lost groups are redone live), and the coordinator's host
(faults on host 0 end the run by design: tests/cluster/test_hosts.py covers it).
Usage: sudo python benchmarks/cluster_campaign.py [--runs 30] [--groups 3] [--steps 24] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives with the tests

from tests.cluster.cluster_run import digests, doc_lines, env, start  # noqa: E402
from tests.cluster.hosts import Cluster, sweep, why_not  # noqa: E402


def schedule(rng: random.Random, groups: int, steps: int) -> tuple[str, str]:
    """(network faults, process faults): 1 to 3 faults on distinct groups among 1 .. groups-1, or (3 in
    10) one process fault on group 0 alone (restarted by torchrun, it heals from the others). Group 0 is
    never faulted beside the others: with every group out at once the run fails by design."""
    net, proc = [], []
    if rng.random() < 0.3:
        step = rng.randint(2, steps // 2)
        kind = rng.choice(["kill", "hang"])
        return "", (f"kill:replica=0,step={step},phase={rng.choice(['compute', 'allreduce', 'commit'])}"
                    if kind == "kill" else f"hang:replica=0,step={step},for={rng.randint(2, 6)}")
    targets = rng.sample(range(1, groups), k=min(groups - 1, rng.randint(1, 3)))
    for g in targets:
        step, host = rng.randint(2, steps // 2), g + 1
        kind = rng.choice(["host", "partition", "cut", "kill", "hang"])
        if kind == "host":
            net.append(f"host:host={host},step={step}")
        elif kind == "partition":
            net.append(f"partition:host={host},step={step},for={rng.randint(3, 8)}")
        elif kind == "cut":
            peer = rng.choice([h for h in range(1, groups + 1) if h != host])
            net.append(f"cut:host={host},peer={peer},step={step},for={rng.randint(3, 16)}")
        elif kind == "kill":
            proc.append(f"kill:replica={g},step={step},phase={rng.choice(['compute', 'allreduce', 'commit'])}")
        else:
            proc.append(f"hang:replica={g},step={step},for={rng.randint(2, 6)}")
    return "; ".join(net), "; ".join(proc)


def reference(groups: int, steps: int) -> dict[int, str]:
    import subprocess
    flags = [a for a in doc_lines()[0].split() if a.startswith("--run.")]
    out = Path(tempfile.mkdtemp(prefix="campaign-ref-")) / "run"
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", *flags, f"--run.replicas={groups}",
                        f"--run.steps={steps}", "--run.progress=false", "--out", str(out)],
                       capture_output=True, text=True, env=env(), timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the failure-free run failed: {r.stderr[-500:]}")
    from unbroken.events import read_events
    return digests(read_events(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    if why_not():
        raise SystemExit(why_not())
    sweep()
    rng = random.Random(args.seed)
    ref = reference(args.groups, args.steps)
    hangs = crashes = divergent = 0
    for k in range(args.runs):
        net, proc = schedule(rng, args.groups, args.steps)
        tmp = Path(tempfile.mkdtemp(prefix=f"campaign-{k}-"))
        flags = [f"--run.replicas={args.groups}", f"--run.steps={args.steps}", "--coord.heartbeat_timeout=2",
                 "--coord.collective_timeout=5", "--coord.progress_timeout=30",
                 "--run.faults=" + "; ".join(filter(None, [proc] + [f"slow:replica={g},from=0,for=0.1"
                                                                  for g in range(args.groups)]))]
        with Cluster(args.groups + 1, tmp) as cluster:
            run = start(cluster, tmp, flags, restarts=1, faults=net, groups=args.groups)
            try:
                code, verdict = run.wait(args.timeout), ""
            except AssertionError:
                code, verdict = None, "HANG"
                hangs += 1
            evs = run.events()
        if code not in (0, None):
            crashes, verdict = crashes + 1, f"CRASH (exit {code})"
        got = digests(evs)
        if code == 0 and got != ref:
            divergent, verdict = divergent + 1, "DIVERGED"
        fired = [e["kind"] for e in evs if e["event"] == "fault"]
        dead = [e["replica"] for e in evs if e["event"] == "member_dead"]
        joins = [e["replica"] for e in evs if e["event"] == "join"]
        print(f"run {k + 1:2d}: {verdict or 'ok':12s} steps {len(got)}/{args.steps}  fired {fired}  dead {dead}  "
              f"rejoined {joins}  net [{net}]  proc [{proc}]  ({tmp})", flush=True)
    print(f"{args.runs} runs, {args.groups} groups on {args.groups + 1} hosts: hangs {hangs}, crashes {crashes}, "
          f"divergences {divergent}")
    print(f"ratio campaign_clean_runs {args.runs - hangs - crashes - divergent}/{args.runs}")


if __name__ == "__main__":
    main()
