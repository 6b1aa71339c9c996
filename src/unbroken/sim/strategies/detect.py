"""unbroken's live recovery with the real fail-slow detector (`unbroken.policy.detection.Detector`).

Owns: turning the simulated run into what the coordinator's detector sees (per-microbatch timings of
committed steps), feeding it, logging its `verdict` / `regime` changes with the coordinator's fields, and
taking the next quotas from `workload.quotas` with weights = `detector.speeds()`. Nothing else tells this
strategy that a replica is slow: slowness reaches it only as longer simulated times. Does not own: the
detection logic (policy/detection.py, policy/predictor.py) or in-step recovery (live.py).

Simulated timings: each microbatch of replica r costs the scenario's `microbatch_seconds` times r's
slowdown factor when its stretch of steps began, times device-time noise of the size measured on real
runs (thread CPU time per microbatch, 4 replicas on 2 shared cores, 8 failure-free runs, residuals of
a fitted cost model after the fleet's per-step median): a replica-step component shared by the step's
microbatches, log-sd STEP_NOISE, persisting from one step to the next with correlation STEP_NOISE_LAG1
(measured 0.02-0.055 and -0.05-0.23), and a per-microbatch one, log-sd MB_NOISE (measured 0.03-0.07);
both drawn from the engine's seeded RNG (same seed, same log). Every microbatch holds
`tokens_per_microbatch` tokens as one sequence (sumsq = tokens^2); the scenario gives no document
lengths, so the predictor's fit is constant across microbatches and only the noise varies.

Coverage: the detector observes every committed step of the whole run (so its false alarms on noise are
counted: `detector` record before run_end), unless the run would commit more than WHOLE_RUN_STEPS steps
(the Llama 3 scenario: ~750,000 steps of 128 replicas would take tens of minutes of detector calls). Then, an
approximation stated in the run_start record, it is called only in windows of `tail_steps` committed
steps opened by every change it could see: a fail-slow episode beginning or ending, a replaced replica
rejoining into a slot still slowed; long enough for a verdict to settle (Suspect, Slow, back to Healthy
after `recover_steps` calm steps), for a speed estimate over `speed_window` steps and for a CUSUM to
drain, and outside them the last speeds stay in force. Each call observes the slowed replicas, those
whose verdict is not Healthy, and the HEALTHY_SAMPLE lowest-numbered other members (deterministic), not
the whole fleet. Steps redone by in-step recovery are not observed.
"""
from __future__ import annotations

import math
from collections import Counter
from itertools import islice
from typing import Any

from unbroken.policy import workload
from unbroken.policy.detection import Detector, RegimeChange, Verdict, VerdictChange
from unbroken.policy.predictor import SameWork
from unbroken.sim.cluster import Fault
from unbroken.sim.gauss import GaussStream
from unbroken.sim.strategies.live import Live

MB_NOISE = 0.05  # measured (see above): log-sd of a microbatch's device time about its replica-step
STEP_NOISE = 0.05  # measured: log-sd of a replica-step's shared component about the fleet's median
STEP_NOISE_LAG1 = 0.2  # measured: its correlation with the same replica's previous step
WHOLE_RUN_STEPS = 5_000  # chosen: runs up to this many steps are observed at every step (~1 ms a step
# at 8 replicas x 8 microbatches: the ResiHP scenarios, ~1,500 steps, take ~1.4 s)
GRACE_STEPS = 5  # a Slow verdict this many steps after its replica's episode ended still counts as true
HEALTHY_SAMPLE = 64  # chosen: healthy members observed per call besides the slowed and unhealthy ones
HEALTHY_WINDOWS = 24  # chosen: windows over healthy stretches per run, evenly spaced (false alarms counted)


class LiveDetect(Live):
    name = "unbroken_detect"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.detector = Detector()
        self.noise = GaussStream(self.engine.rng)  # the engine's stream, drawn in blocks (sim/gauss.py)
        cfg = self.detector.config
        # observed steps after an episode changes: recover_steps calm steps take Slow back to Healthy, a
        # CUSUM at its cap drains by about `drift` a calm step; +1 for the step in flight at the change
        self.tail_steps = cfg.recover_steps + math.ceil(2 * cfg.slow_at / cfg.drift) + 1
        self.tail_until = 0  # observe the committed steps before this one (a window opened by a change)
        self.whole_run = self.horizon / self.t_full <= WHOLE_RUN_STEPS
        self.step_noise: dict[int, float] = {}  # replica -> its replica-step noise component, last step
        self.slowed_until: dict[int, int] = {}  # replica -> last step it was observed slowed
        self.observed = self.false_alarms = self.alarms = 0  # replica-steps observed; Slow verdicts
        self.armed = -1  # seg_id whose next step end has a `detect` event
        self.plan_of = (-1, Counter(), {})  # (seg_id, microbatches per member, slowdown factors != 1)
        self.member_set: tuple[int, frozenset[int]] = (-1, frozenset())  # (seg_id, its members)
        w = self.sc.workload
        self.features = (w.tokens_per_microbatch, float(w.tokens_per_microbatch) ** 2)
        # steps between the starts of healthy-stretch windows: the failure-free step count over HEALTHY_WINDOWS
        self.healthy_every = max(2 * self.tail_steps, round(self.horizon / self.t_full / HEALTHY_WINDOWS))

    def describe(self) -> dict[str, Any]:
        noise = {"mb_log_sd": MB_NOISE, "step_log_sd": STEP_NOISE, "step_lag1": STEP_NOISE_LAG1}
        if self.whole_run:
            return {"detector": "unbroken.policy.detection.Detector", "timing_noise": noise,
                    "detector_coverage": "every committed step", "detector_sample": HEALTHY_SAMPLE,
                    "detector_approximation": f"each call observes the slowed and non-Healthy members plus the "
                    f"{HEALTHY_SAMPLE} lowest-numbered other members; steps redone by in-step recovery are not "
                    "observed"}
        return {"detector": "unbroken.policy.detection.Detector", "timing_noise": noise,
                "detector_coverage": "windows", "detector_sample": HEALTHY_SAMPLE,
                "detector_tail_steps": self.tail_steps,
                "detector_approximation": f"detector called only on the {self.tail_steps} steps after a "
                "fail-slow episode starts or ends or a replaced replica rejoins a slowed slot, and on the "
                f"{self.tail_steps} steps from every {self.healthy_every}th step (healthy stretches: false alarms "
                f"counted), last speeds kept in between; each call observes the slowed and non-Healthy members plus the {HEALTHY_SAMPLE} "
                "lowest-numbered other members; steps redone by in-step recovery are not observed"}

    # ---- when to observe ------------------------------------------------------------------------
    def open_window(self, t: float) -> None:
        """Observe the next `tail_steps` committed steps."""
        if self.seg is not None:
            self.flush(t)  # so that self.step is the step in flight
        self.tail_until = self.step + self.tail_steps

    def on_slow(self, t: float) -> None:
        self.open_window(t)
        super().on_slow(t)

    def active(self) -> bool:
        return self.seg is not None and (self.whole_run or self.step < self.tail_until
                                         or self.step % self.healthy_every < self.tail_steps)

    def arm(self) -> None:
        """Schedule `detect` at the end of the step in flight if a window is open, else at the end of
        the next window's first step; once per stretch at a time."""
        seg = self.seg
        if seg is not None and self.armed != self.seg_id:
            if self.plan_of[0] != self.seg_id:  # first call of a stretch is from `start`: its plan is current
                factors = {r: self.slowdown(r) for r in seg.members if self.slowdown(r) != 1.0}
                counts = Counter(workload.assign(self.M, seg.members, self.weights))
                self.plan_of = (self.seg_id, counts, factors)
            ahead = 0 if self.active() else -self.step % self.healthy_every  # steps to the next healthy window
            self.armed = self.seg_id
            self.engine.at(self.seg.end_time(self.seg_done + ahead + 1), "detect", self.seg_id)

    def start(self, t: float) -> None:
        super().start(t)
        self.arm()

    def mark_out(self, t: float, f: Fault, back_after: float) -> list[int]:
        for r in f.replicas:
            self.detector.forget(r)  # declared dead: a replacement starts with a fresh record
        return super().mark_out(t, f, back_after)

    def on_back(self, t: float, replica: int) -> None:
        if self.slowdown(replica) != 1.0:  # a fresh replica on a slot still in a fail-slow episode
            self.open_window(t)
        if self.weights and self.weights.get(replica, 1.0) != 1.0:
            self.weights = self._weights({r: s for r, s in self.weights.items() if r != replica})
        super().on_back(t, replica)

    # ---- observing one committed step -------------------------------------------------------------
    def _on_detect(self, t: float, seg_id: int) -> None:
        if seg_id != self.seg_id or self.seg is None:
            return  # the stretch was rebuilt; its start armed the next observation
        self.armed = -1
        self.flush(t)
        seg = self.seg
        _, counts, factors = self.plan_of
        verdicts = self.detector.verdicts()
        if self.member_set[0] != self.seg_id:
            self.member_set = (self.seg_id, frozenset(seg.members))
        members = self.member_set[1]
        # the members slowed or not Healthy, found from those few (not by a pass over the fleet)
        keep = {r for r in factors if r in members} | \
            {r for r, v in verdicts.items() if v is not Verdict.HEALTHY and r in members}
        healthy = list(islice((r for r in seg.members if r not in keep), HEALTHY_SAMPLE))
        mb, (tokens, sumsq) = self.sc.workload.microbatch_seconds, self.features
        step = self.step - 1
        timings = {}
        observed = sorted(keep.union(healthy))
        # the deviates in the order one `gauss` call each would draw them: per replica (ascending), its
        # replica-step component, then one per microbatch
        sizes = [1 + counts[r] for r in observed]
        z = self.noise.take(sum(sizes))
        step_z = (0.0 + z * STEP_NOISE).tolist()
        mb_e = list(map(math.exp, (0.0 + z * MB_NOISE).tolist()))
        at, exp, lag, fresh = 0, math.exp, STEP_NOISE_LAG1, math.sqrt(1.0 - STEP_NOISE_LAG1 ** 2)
        for r, size in zip(observed, sizes):
            # AR(1) with stationary log-sd STEP_NOISE: x' = phi x + sqrt(1 - phi^2) e
            shared = lag * self.step_noise.get(r, 0.0) + fresh * step_z[at]
            self.step_noise[r] = shared
            base = mb * factors.get(r, 1.0) * exp(shared)
            timings[r] = SameWork(tokens, sumsq, [base * e for e in mb_e[at + 1:at + size]])
            at += size
            if r in factors:
                self.slowed_until[r] = step
        self.observed += len(timings)
        self.detector.observe(step, timings)
        for c in self.detector.take_events():
            if isinstance(c, VerdictChange):
                # a Slow verdict on a replica not slowed (nor within GRACE_STEPS after its episode)
                false_alarm = (c.new is Verdict.SLOW
                               and step - self.slowed_until.get(c.replica, -10 ** 9) > GRACE_STEPS)
                self.alarms += c.new is Verdict.SLOW
                self.false_alarms += false_alarm
                self.log.emit("verdict", t, step=c.step, replica=c.replica, old=str(c.old), new=str(c.new),
                              speed=round(c.speed, 4), score=round(c.score, 4), noise=round(c.noise, 4),
                              false_alarm=false_alarm)
            elif isinstance(c, RegimeChange):
                self.log.emit("regime", t, step=c.step, device_class=c.device_class, factor=round(c.factor, 4),
                              moved=c.moved, replicas=c.replicas)
        self.arm()  # before any replan, so the next step is observed on this stretch's plan
        self.apply(t, self._weights(self.detector.speeds()))

    def finish(self, t: float) -> dict[str, Any]:
        """The detector's alarms before run_end: Slow verdicts, and those on a replica that was not slowed
        (nor within GRACE_STEPS after its episode): false alarms, per 1,000 replica-steps observed."""
        if self.seg is not None:
            self.flush(t)
        self.log.emit("detector", t, observed_replica_steps=self.observed, alarms=self.alarms,
                      false_alarms=self.false_alarms,
                      false_per_1000=round(1000 * self.false_alarms / self.observed, 4) if self.observed else 0.0,
                      noise={c: round(v, 4) for c, v in self.detector.fleet_noise().items()})
        return super().finish(t)

    def end_fields(self) -> dict[str, Any]:
        return {"false_alarms": self.false_alarms}

    def _weights(self, speeds: dict[int, float]) -> dict[int, float] | None:
        """Quota weights over the whole fleet: unmeasured or Healthy replicas count 1.0; None if all are."""
        w = {r: speeds.get(r, 1.0) for r in range(self.R)}
        return None if all(s == 1.0 for s in w.values()) else w

    def apply(self, t: float, weights: dict[int, float] | None) -> None:
        """Take new speeds; the stretch is rebuilt (next step boundary) only when the quotas change."""
        old, self.weights = self.weights, weights
        members = self.seg.members
        if weights == old:  # quotas are a pure function of (M, members, weights): nothing moves
            return
        if workload.quotas(self.M, members, weights) != workload.quotas(self.M, members, old):
            self.log.emit("quotas", t, step=self.step,
                          weights={str(r): round(s, 4) for r, s in (weights or {}).items() if s != 1.0})
            self.replan(t)


class DetectOnly(LiveDetect):
    """ResiHP's "detector that reports but does not act" baseline: the same detector and verdicts, quotas
    never moved; fail-stops are recovered in-step as by live.py (the group is dropped until replaced)."""
    name = "detect_only"

    def apply(self, t: float, weights: dict[int, float] | None) -> None:
        pass
