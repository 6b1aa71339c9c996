"""Real processes on gloo, through `unbroken train`: the fail-slow detector on device time raises no false
alarm in failure-free runs of the demo's shape, and finds a 1.3x slowdown that burns CPU (how=spin).

Oracle: the coordinator's `verdict` events, the `owners` of each committed `step` record (quotas), and the
`compute` events' two clocks (device `seconds`, which the detector reads, and `wall`).
"""
from __future__ import annotations

import pytest

from tests.conftest import unbroken
from tests.runtime._detector_targets import failing, once_more_if_the_host_moved
from unbroken.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # device time: its noise on a quiet host

# The demo's shape (4 replicas, 8 microbatches, exact), 4 replicas on the machine's cores, with variable
# sequence lengths, so the workload itself moves microbatch times (the predictor must explain it).
DEMO = ["--replicas", "4", "--microbatches", "8", "--exact", "--run.progress=false", "--data.seq_len=variable",
        "--coord.run_timeout=120"]


@pytest.mark.timeout(280)
def test_failure_free_runs_of_the_demo_shape_declare_nobody_slow_and_move_no_quota(tmp_path):
    once_more_if_the_host_moved(lambda attempt: failure_free_runs(tmp_path / f"attempt{attempt}"), 0)


def failure_free_runs(tmp_path) -> None:
    steps = 24
    for seed in (1, 2, 3):
        out = tmp_path / f"run{seed}"
        r = unbroken("train", *DEMO, "--steps", str(steps), f"--run.seed={seed}", "--out", str(out), timeout=100)
        assert r.returncode == 0, r.stderr[-2000:]
        events = read_events(out)
        computes = [e for e in events if e["event"] == "compute"]
        assert len(computes) >= steps * 8
        # The detector's clock is the computing thread's CPU time: never more than the wall time around
        # it (one torch thread), and on 4 replicas sharing fewer cores, often much less.
        assert all(0 < e["seconds"] <= e["wall"] + 1e-4 for e in computes), \
            [e for e in computes if not 0 < e["seconds"] <= e["wall"] + 1e-4][:3]
        slow = [e for e in events if e["event"] == "verdict" and e["new"] == "slow"]
        if slow:
            raise failing(f"seed {seed}: declared slow {slow}", events, slow)
        owners = [e["owners"] for e in events if e["event"] == "step"]
        assert len(owners) == steps
        assert all(sorted(len(v) for v in o.values()) == [2, 2, 2, 2] for o in owners), owners
        # The launcher prints Slow verdicts only: none here, so none on the user's screen either.
        assert "verdict" not in r.stdout + r.stderr


@pytest.mark.timeout(230)
def test_a_1_3x_spin_slowdown_is_declared_slow_within_5_steps_and_recovers(tmp_path):
    once_more_if_the_host_moved(lambda attempt: slowdown_run(tmp_path / f"attempt{attempt}"), 0)


def slowdown_run(tmp_path) -> None:
    onset, end, steps = 5, 13, 22
    out = tmp_path / "slow"
    r = unbroken("train", *DEMO, "--steps", str(steps), "--microbatches", "16", "--run.quotas=equal",
                 "--faults", f"slow:replica=2,from={onset},to={end},factor=1.3,how=spin", "--out", str(out),
                 timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    fired = [e for e in events if e["event"] == "compute" and e["replica"] == 2 and onset <= e["step"] < end]
    others = [e for e in events if e["event"] == "compute" and e["replica"] != 2 and onset <= e["step"] < end]
    assert fired and others
    # The spin is real CPU work in the computing thread: replica 2's device time per token is ~1.3x its peers'.
    per_token = lambda es: sorted(e["seconds"] / e["tokens"] for e in es)[len(es) // 2]  # noqa: E731
    ratio = per_token(fired) / per_token(others)
    if not 1.15 < ratio < 1.5:
        raise failing(f"the slowed replica's device time per token was {ratio:.2f}x its peers'", events)
    verdicts = [(e["step"], e["replica"], e["new"]) for e in events if e["event"] == "verdict"]
    slow = [s for s, rep, new in verdicts if new == "slow"]
    wrong = [e for e in events if e["event"] == "verdict" and e["new"] == "slow" and e["replica"] != 2]
    # Through `failing` as the targets below: on a host whose speed moved fleet-wide (regime records) a
    # healthy replica was declared Slow in CI (at 5ec57e0: replica 1 at step 19, in a run with 0.66x and
    # 1.36x moves of every replica's device time), where it must fail at once on a steady host.
    if not slow:
        raise failing(f"replica 2 never declared slow: {verdicts}", events)
    if wrong:
        raise failing(f"a replica other than the slowed one declared slow: {verdicts}", events, wrong)
    # By design a sustained 1.3x reaches Slow on its 3rd step (CUSUM 3 x (0.26 - 0.077) = 0.55 >= 0.45);
    # step-to-step noise of device time (replica-step log-sd ~0.05 here) makes it later at times: the 4th
    # in 1 of 4 runs on a loaded host, the 5th once in a full-suite run. The target (3 steps) is
    # not met every time; asserted here: within 5 (the onset step is the 1st), and never before the onset.
    if not onset <= slow[0] <= onset + 4:
        raise failing(f"declared slow at step {slow[0]}, not within {onset}..{onset + 4}: {verdicts}", events)
    healthy_again = [s for s, rep, new in verdicts if rep == 2 and new == "healthy" and s >= end]
    if not (healthy_again and healthy_again[0] <= end + 5):
        raise failing(f"not healthy again by step {end + 5}: {verdicts}", events)
