"""The rule for the detector's targets in tests through real processes (test_failslow_real.py,
test_slowness_e2e.py): a target that fails is run once more, and two failures in a row fail the test
unless the host itself made both fail (then an expected failure, naming what the host did).

The host made a target fail when, in that attempt, either
- the host moved fleet-wide: a `regime` record (every replica's device time moved together by >15%), or
- every Slow verdict the target objects to is backed by the device clock: the flagged replica's own
  `compute` records show its device time at least `BACKED` times its peers' over the steps that led to
  the verdict (an offline fit of the cost model over the whole run, independent of the detector's online
  predictor and CUSUM). A detector that flags a replica its clock does not show slow still fails.

A target raises `failing(message, events, flagged)` instead of a plain `assert`; whatever else a test
checks (a fault fired, the trajectory, the audit) stays a plain assertion and fails at once.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest

from unbroken.policy.predictor import MicrobatchTiming, fit_cost_model, median

BACKED = 1.2  # device time over the peers' that counts as the clock showing a replica slow
EVIDENCE_STEPS = 3  # steps up to and including the verdict's: the fewest a sustained 1.3x needs for Slow


def once_more_if_the_host_moved(check, attempt: int, excused_before: bool = False) -> None:
    """Run `check(attempt)`; if one of the detector's targets fails (an error made by `failing`), run it
    once more. If that attempt fails too, the test fails, unless the host made both attempts fail (see
    the module docstring): then it is an expected failure, with what the host did in its reason, as the
    calibration tests skip when the host lacks their premise.

    Why once more on any target: on 2026-11-26 this host's device time per token spread around each
    step's fleet median with a replica-step log-sd of 0.13-0.17 in every run (the detector is designed
    for ~0.05), and full-suite runs (at 6c96962, at f4a25c6 twice in a row) saw a healthy replica declared
    Slow in a run without a fleet-wide move: its device clock read 1.35-1.4x its peers' for steps on end
    (verdict speeds 0.71-0.74), which is what the detector is built to flag. Two failures in a row that
    the host did not excuse still fail."""
    try:
        check(attempt)
    except AssertionError as e:
        if not hasattr(e, "excused"):  # not a detector target: the run itself went wrong
            raise
        if attempt:
            if e.excused and excused_before:
                pytest.xfail(f"the host made both attempts fail ({e.why}): {str(e)[:300]}")
            raise
        print(f"attempt 1 failed (host: {e.why or 'nothing'}); once more: {str(e)[:300]}")
        once_more_if_the_host_moved(check, attempt + 1, e.excused)


def failing(message: str, events: list[dict], flagged: list[dict] = ()) -> AssertionError:
    """The error a detector target raises. `flagged`: the `verdict` records (new == "slow") the target
    objects to, if that is its objection; each is checked against the device clock."""
    e = AssertionError(message)
    shifts = [round(r["factor"], 2) for r in events if r["event"] == "regime"]  # fleet-wide moves
    clock = [(v["step"], v["replica"], clock_ratio(events, v["step"], v["replica"])) for v in flagged]
    backed = bool(clock) and all(ratio >= BACKED for _, _, ratio in clock)
    e.excused = bool(shifts) or backed
    e.why = "; ".join(filter(None, [
        f"fleet-wide device-time moves {shifts}" if shifts else "",
        "device clock of the flagged (step, replica): " + ", ".join(f"({s}, {r}) {x:.2f}x its peers'"
                                                                  for s, r, x in clock) if clock else ""]))
    return e


def clock_ratio(events: list[dict], step: int, replica: int) -> float:
    """How many times its peers' device time `replica` took over the `EVIDENCE_STEPS` steps up to `step`,
    by its compute records: the median over those steps of its microbatches' median log(seconds /
    predicted) minus the step's median over replicas, with the cost model fit on the whole run's records
    (so sequence lengths are explained). 1.0 when the records lack those steps."""
    computes = [c for c in events if c["event"] == "compute"]
    if len(computes) < 3:
        return 1.0
    model = fit_cost_model([MicrobatchTiming(c["tokens"], c["sumsq"], c["seconds"]) for c in computes])
    logs: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in computes:
        if step - EVIDENCE_STEPS < c["step"] <= step:
            logs[c["step"]][c["replica"]].append(math.log(c["seconds"] / model.predict(c["tokens"], c["sumsq"])))
    per_step = []
    for s, by_replica in logs.items():
        meds = {r: median(xs) for r, xs in by_replica.items()}
        if replica in meds:
            per_step.append(meds[replica] - median(list(meds.values())))
    return math.exp(median(per_step)) if per_step else 1.0
