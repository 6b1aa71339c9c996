"""unbroken_detect learns of slowness only through the real detector: verdicts, then quotas from its speeds."""
from __future__ import annotations

import pytest

from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import detect


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
        assert set(r) == {"event", "t", "step", "replica", "old", "new", "speed", "score", "false_alarm"}
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
    assert quotas[-1]["weights"] == {}  # every replica healthy again: equal quotas


@pytest.mark.timeout(30)
def test_no_slowness_no_alarm_though_the_detector_runs(monkeypatch):
    """Over healthy stretches the detector runs too (HEALTHY_WINDOWS windows), so a false alarm would be
    counted; with no slowness and 3% noise there is none."""
    calls = []
    observe = detect.Detector.observe
    monkeypatch.setattr(detect.Detector, "observe", lambda self, *a: calls.append(a[0]) or observe(self, *a))
    sc = load("scenarios/resihp_256_failstop.toml")
    recs = simulate(sc, "unbroken_detect", seed=0, keep=True).records
    end = next(r for r in recs if r["event"] == "run_end")
    windows = {s // 10 for s in calls}  # steps observed, by tens: the windows are ~23 steps long
    assert len(calls) >= detect.HEALTHY_WINDOWS // 2 * 20 and len(windows) >= detect.HEALTHY_WINDOWS // 2
    assert end["false_alarms"] == 0
    assert not [r for r in recs if r["event"] in ("verdict", "quotas")]


@pytest.mark.timeout(30)
def test_false_alarms_are_counted(monkeypatch):
    """The count can fail: timings far noisier than the predictor expects raise alarms on healthy replicas."""
    monkeypatch.setattr(detect, "TIMING_NOISE", 0.9)
    sc = load("scenarios/resihp_256_failstop.toml")
    recs = simulate(sc, "unbroken_detect", seed=0, keep=True).records
    alarms = [r for r in recs if r["event"] == "verdict" and r["false_alarm"]]
    assert alarms and next(r for r in recs if r["event"] == "run_end")["false_alarms"] == len(alarms)
