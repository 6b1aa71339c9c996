"""What a run's host did, read from its raw `compute` records, independently of the fail-slow detector.

Owns: per replica-step residuals of device time (each microbatch's log(seconds / predicted) under a cost
model fit offline on the whole run's records, so sequence lengths are explained; a replica-step's
residual is the median over its microbatches, less the median over the step's replicas), and from them
the host's noise (their winsorized standard deviation over replica-steps free of injected slowness) and a
replica's slowdown over a range of steps (exp of its median residual there). The detector's own
estimate (policy/noise.py) is online, over Healthy steps, from its predictor's rolling fit; this one
shares none of its state, so tests can state the host's premise with it and detect-eval can print both.
Does not own: the detector, the evaluation's scoring (replay.py) or running anything.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

from unbroken.policy.noise import robust_sd
from unbroken.policy.predictor import MicrobatchTiming, fit_cost_model, median


def residuals(records: Iterable[dict], skip_steps: int = 2) -> dict[int, dict[int, float]]:
    """step -> replica -> that replica-step's residual (log units), from the `compute` records of steps
    `skip_steps` and later (the run's start-up is not its noise). Every compute record counts (a redone
    microbatch too: it ran on that device). {} with fewer than 3 records."""
    computes = [c for c in records if c["event"] == "compute" and c["seconds"] > 0 and c["step"] >= skip_steps]
    if len(computes) < 3:
        return {}
    model = fit_cost_model([MicrobatchTiming(c["tokens"], float(c["sumsq"]), c["seconds"]) for c in computes])
    logs: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in computes:
        logs[c["step"]][c["replica"]].append(math.log(c["seconds"] / model.predict(c["tokens"], float(c["sumsq"]))))
    out: dict[int, dict[int, float]] = {}
    for s, by_replica in sorted(logs.items()):
        meds = {r: median(xs) for r, xs in by_replica.items()}
        centre = median(list(meds.values()))
        out[s] = {r: m - centre for r, m in sorted(meds.items())}
    return out


def noise(res: dict[int, dict[int, float]], slowed: Callable[[int, int], bool] = lambda s, r: False) -> float:
    """Robust sd (policy/noise.py's estimator, without its margin) of the residuals of replica-steps where
    `slowed(step, replica)` is false; nan if none."""
    xs = [x for s, by in res.items() for r, x in by.items() if not slowed(s, r)]
    return robust_sd(xs) if xs else math.nan


def slowdown(res: dict[int, dict[int, float]], replica: int, steps: range) -> float:
    """exp of `replica`'s median residual over `steps`: how many times its peers' device time it took
    (1.0 when the records lack those steps)."""
    xs = [res[s][replica] for s in steps if s in res and replica in res[s]]
    return math.exp(median(xs)) if xs else 1.0
