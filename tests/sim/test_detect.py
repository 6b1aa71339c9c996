"""unbroken_detect learns of slowness only through the real detector: verdicts, then quotas from its speeds."""
from __future__ import annotations

import pytest

from unbroken.policy import workload
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies.detect import STEP_NOISE


@pytest.mark.timeout(30)
def test_detector_verdicts_drive_quotas():
    sc = load("scenarios/resihp_256_failslow.toml")
    recs = simulate(sc, "unbroken_detect", seed=0, keep=True).records
    start = next(r for r in recs if r["event"] == "run_start")
    assert "detector_approximation" in start and start["detector_sample"] > 0
    slows = [r for r in recs if r["event"] == "slow" and r["factor"] > 1]
    verdicts = [r for r in recs if r["event"] == "verdict"]
    quotas = [r for r in recs if r["event"] == "quotas"]
    assert len(slows) == len(sc.trace)
    for r in verdicts:
        assert set(r) == {"event", "t", "step", "replica", "old", "new", "speed", "score", "noise",
                          "false_alarm"}
        assert r["false_alarm"] is False
    for onset in slows:
        after = [v for v in verdicts if v["replica"] == onset["replica"] and v["t"] >= onset["t"]]
        # healthy -> suspect -> slow within a few steps, then back to healthy after the episode
        assert [(v["old"], v["new"]) for v in after[:3]] == [("healthy", "suspect"), ("suspect", "slow"),
                                                           ("slow", "healthy")]
        confirmed, recovered = after[1], after[2]
        assert confirmed["t"] - onset["t"] < 10 * start["step_seconds"] * onset["factor"]
        assert recovered["t"] >= onset["until"]
        # the estimate comes from noisy timings: near 1/factor, not equal to it
        assert confirmed["speed"] == pytest.approx(1 / onset["factor"], rel=0.1)
        q = next(q for q in quotas if q["t"] >= confirmed["t"])
        assert q["weights"] == {str(onset["replica"]): confirmed["speed"]}
    # every replica healthy again: the last weights give equal quotas (the estimate recovers over a few
    # steps, so the last record may still hold a weight just under 1 that no longer moves a microbatch)
    last = {int(r): w for r, w in quotas[-1]["weights"].items()}
    members = range(sc.cluster.dp)
    assert workload.quotas(sc.workload.microbatches, members, last or None) == workload.quotas(
        sc.workload.microbatches, members)
    assert verdicts[-1]["new"] in ("healthy", "suspect") or verdicts[-1]["old"] == "slow"
    detector = next(r for r in recs if r["event"] == "detector")
    assert detector["alarms"] == len(slows) and detector["false_alarms"] == 0


@pytest.mark.timeout(30)
def test_whole_run_on_measured_noise_no_slowness_no_alarm():
    """No fail-slow in the scenario: the detector still sees every committed step, with device-time
    noise of the size measured on real runs, and declares nobody Slow and moves no quota."""
    sc = load("scenarios/resihp_256_failstop.toml")
    recs = simulate(sc, "unbroken_detect", seed=0, keep=True).records
    start = next(r for r in recs if r["event"] == "run_start")
    assert start["detector_coverage"] == "every committed step"
    end = next(r for r in recs if r["event"] == "run_end")
    detector = next(r for r in recs if r["event"] == "detector")
    # every committed step observed on every member (fewer while a replica is out or a step is redone)
    assert 0.8 * end["steps_committed"] * sc.cluster.dp <= detector["observed_replica_steps"] <= \
        end["steps_committed"] * sc.cluster.dp
    assert detector["alarms"] == detector["false_alarms"] == 0
    # the noise it measured is the simulated noise's: a replica-step log-sd of STEP_NOISE (plus the
    # median of its microbatches' noise), within the estimate's spread
    assert 0.6 * STEP_NOISE <= detector["noise"]["default"] <= 1.6 * STEP_NOISE, detector
    assert not [r for r in recs if r["event"] == "quotas" or (r["event"] == "verdict" and r["new"] == "slow")]
