"""Real processes on gloo, through `unbroken train`: a slow replica is detected and given less work, and
moving work never changes the trajectory.

Oracle: the coordinator's `verdict` events and the `owners` of each committed `step` record for the
closed loop; for the math, every committed step's param_digest in --exact mode against a failure-free
--exact run of the same config (quotas only decide who computes a microbatch, never what is summed).
"""
from __future__ import annotations

import pytest

from tests.conftest import unbroken
from unbroken.eval import host
from unbroken.events import read_events
from unbroken.observe.runs import audit, compare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

SLOW = 3  # the slowed replica
STEPS = 16
# 12 microbatches: equal quotas are 3 each; at speeds 1,1,1,1/3 they become about 4,4,3,1.
RUN = ["--replicas", "4", "--steps", str(STEPS), "--microbatches", "12", "--exact", "--run.progress=false",
       "--data.seq_len=variable", "--run.quotas=speed", "--coord.heartbeat_timeout=3.0",
       "--coord.run_timeout=180"]


@pytest.mark.alone  # device time: its noise on a quiet host (as test_failslow_real.py)
def test_slow_replica_is_declared_slow_gets_less_work_and_the_trajectory_is_unchanged(tmp_path):
    """One try, no retry: the detector's thresholds follow the noise it measures (policy/noise.py), which
    this test prints beside the noise of the raw records (unbroken/eval/host.py)."""
    ref, out = tmp_path / "reference", tmp_path / "slow"
    r = unbroken("train", *RUN, "--out", str(ref), timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    r = unbroken("train", *RUN, "--faults", f"slow:replica={SLOW},from=2,factor=3,how=spin", "--out", str(out), timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    # the fault fired: the slowed replica's device time per token is well above its peers' from step 2 on
    per_token = lambda es: sorted(e["seconds"] / e["tokens"] for e in es)[len(es) // 2]  # noqa: E731
    computes = [e for e in events if e["event"] == "compute" and e["step"] >= 2]
    ratio = per_token([e for e in computes if e["replica"] == SLOW]) / \
        per_token([e for e in computes if e["replica"] != SLOW])
    assert ratio > 2.0, ratio  # 3x by a CPU spin: 3.7x measured here (2026-11-27; the spin slows what follows it)
    for name, events_of in (("slowed run", events), ("reference", read_events(ref))):
        noise = [e["fleet"]["default"] for e in events_of if e["event"] == "noise"]
        print(f"{name}: device-time noise {host.noise(host.residuals(events_of), lambda s, r: r == SLOW):.3f} "
              f"by the raw records of the healthy replicas, {noise[-1] if noise else float('nan'):.3f} by the "
              f"detector; verdicts: {[(e['step'], e['replica'], e['new']) for e in events_of if e['event'] == 'verdict']}")

    # Declared Slow from measured times alone (the coordinator never sees the fault spec), early enough
    # that later steps can show the new quotas: the earliest is step 3 (two steps of evidence, capped at
    # max_increment each); on this shared 2-core machine it has taken up to ~8.
    declared = [e["step"] for e in events if e["event"] == "verdict" and e["replica"] == SLOW and e["new"] == "slow"]
    assert declared and declared[0] <= STEPS - 4, \
        f"replica {SLOW} declared slow at {declared}, not by step {STEPS - 4}: " \
        f"{[e for e in events if e['event'] in ('verdict', 'regime')]}"

    # Its speed is published after that commit and taken by a later step's plan: from then on it holds
    # fewer microbatches than every other replica (checked on the steps after the first such step, so a
    # recovery (Slow -> Healthy on a calm-looking step) does not fail the test, but one must happen).
    owners = {e["step"]: {int(k): len(v) for k, v in e["owners"].items()} for e in events if e["event"] == "step"}
    later = [s for s in sorted(owners) if s > declared[0]]
    lighter = [s for s in later if owners[s][SLOW] < min(n for k, n in owners[s].items() if k != SLOW)]
    assert lighter, {s: owners[s] for s in later}
    assert sum(owners[s][SLOW] for s in later) < min(sum(owners[s][k] for s in later) for k in range(3))

    # Healthy replicas are never declared Slow, here or in the reference run: the detector reads device
    # time (the computing thread's CPU time), which waiting for one of the 2 shared cores does not add
    # to. (On wall time, single replicas' microbatch times jumped 2-6x for a step or two on this machine
    # and this could not be asserted.)
    for events_of in (events, read_events(ref)):
        wrong = [e for e in events_of if e["event"] == "verdict" and e["new"] == "slow" and e["replica"] != SLOW]
        assert not wrong, f"a healthy replica declared slow: {wrong}"

    # Trajectory: bit for bit the failure-free run's, step by step.
    cmp = compare(ref, out)
    assert cmp.identical == cmp.total == STEPS, [row for row in cmp.rows if not row[3]]
    assert audit(out, 12) == []  # uneven quotas still reduce every microbatch exactly once
