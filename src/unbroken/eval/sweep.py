"""The fail-slow detector across host noise: trace replay (replay.py) at replica-step noise 0.05 to 0.2.

Owns: one synthetic scenario shaped as `unbroken detect-eval`'s real runs (4 replicas, 16 microbatches a
step, variable lengths, one slowdown of 1.1-4x per trace), generated at each noise level with the same
seeds, replayed through a fresh Detector, and scored as the real runs are: precision, recall, recall of
the episodes of 1.3x and more, false alarms per 1,000 replica-steps, latency, and the noise the detector
measured beside the noise put in, with the latency its thresholds state at that noise
(`Thresholds.latency`). Does not own: the traces or the scoring (replay.py), the detector (policy/).

Pure and deterministic; ~1 s per level and 8 seeds.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from unbroken.eval.replay import Tally, TraceConfig, generate, recall_above, replay, unbroken_method
from unbroken.policy.detection import Detector, DetectorConfig
from unbroken.policy.noise import thresholds
from unbroken.policy.predictor import median

LEVELS = (0.05, 0.1, 0.15, 0.2)
SCENARIO = TraceConfig(replicas=4, steps=300, microbatches=16, noise=0.05, slowdowns=3, factor=(1.1, 4.0),
                       duration=(8, 20), warmup=10, grace=5)


@dataclass(frozen=True)
class Level:
    step_noise: float  # put in: the replica-step log-sd of the traces
    measured: float  # the detector's fleet noise at the traces' ends (median over seeds)
    tally: Tally
    replicas: int
    latency_1_3x: float  # the thresholds' stated latency at the measured noise (steps; inf: never)
    latency_2x: float

    @property
    def false_per_1000(self) -> float:
        return 1000 * self.tally.false_alarms / (self.tally.steps * self.replicas) if self.tally.steps else math.nan

    @property
    def recall_1_3x(self) -> float:
        return recall_above(self.tally, 1.3)


def sweep(seeds: range = range(8), levels: tuple[float, ...] = LEVELS, base: TraceConfig = SCENARIO) -> list[Level]:
    """Each level of replica-step noise over the same seeds. Call once; returns the levels in order."""
    out = []
    for level in levels:
        cfg = dataclasses.replace(base, step_noise=level)
        tally, measured, config = Tally(), [], DetectorConfig()
        for seed in seeds:
            det = Detector(config)
            replay(generate(cfg, seed), unbroken_method(det), tally)
            measured.append(det.fleet_noise().get("default", math.nan))
        m = median(measured)
        at = thresholds(m, config.base(), config.noise)
        out.append(Level(level, m, tally, cfg.replicas, at.latency(1.3), at.latency(2.0)))
    return out


def table(levels: list[Level], title: str):
    """A rich Table of the sweep."""
    from rich.table import Table

    def fmt(x: float, spec: str = ".2f") -> str:
        return "-" if math.isnan(x) else "never" if math.isinf(x) else format(x, spec)

    t = Table(title=title, title_justify="left")
    for col in ("step noise in", "noise measured", "precision", "recall", "recall >= 1.3x", "false /1k replica-steps",
                "latency steps med", "stated 1.3x", "stated 2x"):
        t.add_column(col, justify="right")
    for lv in levels:
        m = lv.tally.metrics()
        t.add_row(f"{lv.step_noise:.2f}", fmt(lv.measured, ".3f"), fmt(m.precision), fmt(m.recall),
                  fmt(lv.recall_1_3x), fmt(lv.false_per_1000, ".1f"), fmt(m.latency_median, "g"),
                  fmt(lv.latency_1_3x, "g"), fmt(lv.latency_2x, "g"))
    return t
