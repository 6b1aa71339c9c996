"""Fail-slow detection in the coordinator: committed steps' timings in, quota weights out.

Owns: reading each committed step's per-microbatch timings from the store (members publish them with
their done record), feeding `policy.detection.Detector`, logging its verdict and regime changes, and
publishing its speeds as the `weights` key that the next step's plan takes (when quotas follow speed).
A group entering or leaving Slow is re-planned by `planner` (coordinator/replan.py: the scheduler's decision,
of which this runtime executes keep or reweight); the weights published are then the speeds of the groups
whose applied option is reweight. Does not own: the detection logic (policy/detection.py) or slowness injection (faults.py): injected
slowness reaches this module only as longer measured times, never as a flag.
"""
from __future__ import annotations

import json
import math
import time

from torch.distributed import TCPStore

from unbroken.config import DetectorSection
from unbroken.events import EventLog
from unbroken.policy.detection import Detector, DetectorConfig, RegimeChange, VerdictChange
from unbroken.policy.noise import NoiseConfig
from unbroken.policy.predictor import MicrobatchTiming, Predictor
from unbroken.policy.workload import worth_replanning
from unbroken.runtime.store import keys
from unbroken.runtime.store.watch import publish_weights
from unbroken.runtime.coordinator.replan_measure import Measurer, Pending, fields
from unbroken.policy.replan_plans import plans_from, plans_json
from unbroken.runtime.coordinator.replan import GroupPlanner
from unbroken.runtime.store.client import read

NOISE_MOVE = 0.2  # a class's measured noise is logged again when it moved by this share of the last logged


def detector_for(settings: DetectorSection | None = None) -> Detector:
    """The fail-slow detector under config [detector] (None: its defaults, the policy's own): the slowdown
    ratios there are the detector's log-unit thresholds here."""
    if settings is None:
        return Detector()
    d = settings
    return Detector(DetectorConfig(
        drift=math.log(d.drift_ratio), suspect_at=d.suspect_at, slow_at=d.slow_at, max_increment=d.max_increment,
        recover_below=math.log(d.recover_below_ratio), recover_steps=d.recover_steps,
        regime_move=math.log(d.regime_move_ratio), regime_quorum=d.regime_quorum, min_fleet=d.min_fleet,
        speed_window=d.speed_window, min_speed=d.min_speed, warmup_steps=d.warmup_steps,
        warmup_drift=math.log(d.warmup_drift_ratio), join_skip=d.join_skip,
        noise=NoiseConfig(design_noise=d.design_noise, window=d.noise_window, cap=d.noise_cap,
                          drift_sigmas=d.drift_sigmas, suspect_sigmas=d.suspect_sigmas, slow_sigmas=d.slow_sigmas,
                          recover_sigmas=d.recover_sigmas)),
        Predictor(d.predictor_window, d.refit_every, d.min_samples))


def group_timings(done: dict, ranks: list[dict]) -> list[MicrobatchTiming]:
    """A member's timings of one step from its done record (rank 0's: [tokens, sumsq, seconds] a
    microbatch) and, in a group of several ranks, ranks 1.. own records (`keys.rank_done`: their
    seconds, in the order of their `held`): each microbatch at its slowest rank's seconds (the others
    wait for it in their collectives without spending device time, so rank 0's own clock would never
    show a slow rank j), with every rank's by rank (policy/locating.py finds the slow one)."""
    own = {i: t for i, t in zip(done["held"], done["timings"])} if "held" in done else None
    if not ranks or own is None:
        return [MicrobatchTiming(t[0], t[1], t[2], ()) for t in done["timings"]]
    others = [dict(zip(r["held"], r["seconds"])) for r in ranks]
    out = []
    for i, (tokens, sumsq, seconds) in own.items():
        each = [seconds, *(o[i] for o in others if i in o)]
        out.append(MicrobatchTiming(tokens, sumsq, max(each), tuple(round(v, 6) for v in each)))
    return out


class SlownessMonitor:
    """Call `poll(epoch)` every beat round of the coordinator (a round trip, plus two for each step
    committed since); `forget(r)` when a member is declared dead."""

    def __init__(self, store: TCPStore, log: EventLog, quotas: str, planner: GroupPlanner | None = None,
                 settings: DetectorSection | None = None):
        """`quotas` is config run.quotas: "speed" publishes weights that follow speed, "drop" (with a
        planner) those that park a Slow group, "equal" none. `settings`: config [detector] (None: defaults)."""
        self.store, self.log, self.planner = store, log, planner
        self.publishes = quotas == "speed" or (quotas == "drop" and planner is not None)
        self.detector = detector_for(settings)
        # steps a taking-over coordinator replays into its detector: the predictor's window and the speed
        # window fill from them; older CUSUM evidence is forgotten
        self.replay_steps = (settings or DetectorSection()).replay_steps
        self.next_step = 0
        self.published: dict[int, float] = {}  # the weights last written ({} = equal)
        self.members: dict[int, list[int]] = {}  # epoch -> its member list, as read once
        self.replayed = -1  # steps up to here are replayed (catch_up): their events were logged before
        self.measurer = Measurer()  # re-plans applied (not drops), until measured (coordinator/replan_measure.py)
        self.commit_epoch = -1  # the epoch the step `_timings` last read committed in
        self.noise_logged: dict[str, float] = {}  # device class -> its noise in the last `noise` record

    def catch_up(self) -> None:
        """For a coordinator taking over (etcd standby): rebuild the detector from the last `replay_steps`
        committed steps' timings in the store, not from step 0 (a month of steps would be millions of
        reads), logging nothing and publishing no weights for them (the leader before did)."""
        last = int(read(self.store, keys.last_commit()) or -1)
        self.next_step, self.replayed = max(0, last - self.replay_steps + 1), last
        self.published = {int(k): v for k, v in json.loads(read(self.store, keys.weights()) or b"{}").items()}
        if self.planner is not None:
            self.planner.resume(self.published, plans_from(read(self.store, keys.shrunk())))

    def poll(self, epoch: int) -> None:
        last = int(read(self.store, keys.last_commit()) or -1)
        while self.next_step <= last or self._committed(self.next_step, epoch):
            timings = self._timings(self.next_step, epoch)
            if timings and self.next_step <= self.replayed:
                self.detector.observe(self.next_step, timings)
                self.detector.take_events()
                if self.planner is not None:  # a rank lost right after a takeover is priced, not dropped
                    self.planner.observe(timings)
            elif timings:
                self.detector.observe(self.next_step, timings)
                changes = self.detector.take_events()
                self._log(changes)
                self._log_noise()
                if self.planner is not None:
                    for group, why, r in self.planner.on_verdicts([c for c in changes if isinstance(c, VerdictChange)],
                                                                  timings, self.detector.predictor, sorted(timings)):
                        self.measurer.begin(group, why, r.applied, self.next_step, time.time(), (),
                                            self.commit_epoch)
                # before the speeds: a measured shrunk group's quota weight is its measured speed from now on
                for p in self.measurer.observe(self.next_step, timings, self.commit_epoch):
                    self._measured(p)
                # Written only when the quotas they give are predicted to be worth it: members cache
                # the weights for their plan proposals (a proposal that differs from the agreed plan
                # can cost a redo), and jitter in the estimates must not move microbatches to and fro.
                speeds = {r: round(v, 2) for r, v in self.detector.speeds().items()}
                if self.planner is not None:  # a group's speed moves its quotas only while it is reweighted
                    speeds = {r: self.planner.weight_of(r, v) for r, v in speeds.items()}
                total = sum(len(t) for t in timings.values())  # every microbatch is held once: M
                if self.publishes and worth_replanning(total, sorted(timings), self.published, speeds):
                    self._publish(speeds)
            self.next_step += 1

    def evictions(self) -> dict[int, str]:
        """Groups to declare dead now, each for its located slow rank (group -> the reason naming it):
        the scheduler chose to shrink them around it (replanning.GroupPlanner.evictions). Call after each
        `poll`."""
        return self.planner.evictions() if self.planner is not None else {}

    def rank_lost(self, group: int, alive: list[int], members: list[int], epoch: int = -1) -> str:
        """A group whose survivors `alive` ask to go on without its lost ranks: "shrink" (the scheduler
        chose it: the group's quota weight becomes its smaller plan's, published now) or "drop" (its
        choice, or no planner). Call once per request, from the coordinator's admission round, with the
        `epoch` in force (a shrink's measurement counts only steps committed after it)."""
        if self.planner is None:
            return "drop"
        r = self.planner.on_rank_lost(group, alive, self.next_step, members, self.detector.predictor)
        if r is None or r.applied.kind != "shrink":
            return "drop"
        # each stage of the shrunk plan is one process (stage k reports as rank k), reporting its shard indices' heals
        self.measurer.begin(group, "rank lost", r.applied, self.next_step, time.time(),
                            tuple(range(len(r.applied.plan.teams))), epoch)
        self._save_shrunk()
        if self.publishes:
            self._publish({**{m: self.published.get(m, 1.0) for m in members}, group: round(r.applied.plan.weight, 4)})
        return "shrink"

    def ranks_back(self, group: int, members: list[int], epoch: int = -1) -> None:
        """A group that ran shrunk is admitted at its full plan again: its quota weight back to equal (1.0,
        published now), and the scheduler's view of it logged. Call from the admission round."""
        if self.planner is None:
            return
        r = self.planner.on_ranks_back(group, self.next_step, members, self.detector.predictor)
        if r is not None and r.applied.kind == "grow":
            self.measurer.begin(group, "ranks back", r.applied, self.next_step, time.time(),
                                range(self.planner.shape.group_size), epoch)
        self._save_shrunk()
        if self.publishes and self.published.get(group, 1.0) != 1.0:
            self._publish({**self.published, group: 1.0})

    def _save_shrunk(self) -> None:
        """Keep the planner's shrunk groups in the store for a successor (`catch_up`): after each change
        (a shrink, a group admitted whole again; one write each, both rare)."""
        self.store.set(keys.shrunk(), plans_json(self.planner.shrunk_plans()))

    def _publish(self, weights: dict[int, float]) -> None:
        """Write `weights` for the members' next proposals, and say so (`quotas`, as the simulator does):
        the first step they can plan is the step after the next one to commit."""
        publish_weights(self.store, json.dumps(weights))
        self.published = weights
        self.log.emit("quotas", step=self.next_step, weights={str(r): w for r, w in sorted(weights.items())})

    def _measured(self, p: Pending) -> None:
        """Log `group_plan_measured` for `p`, with the heal reports its joiner's ranks wrote for the epoch
        that admitted it (a few reads, once per shrink or grow)."""
        admitted = int(read(self.store, keys.joined(p.group)) or -1)
        reports = [read(self.store, keys.healed(p.group, admitted, j)) for j in p.ranks]
        record = fields(p, [json.loads(r) for r in reports if r is not None])
        weight = self.planner.measured(p.group, record["measured_weight"]) if p.option.kind == "shrink" else None
        if weight is not None:
            self._save_shrunk()
        self.log.emit("group_plan_measured", step=p.seen[-1][0], quota_weight=weight, **record)

    def forget(self, replica: int) -> None:
        self.measurer.forget(replica)
        self.detector.forget(replica)
        if self.planner is not None:
            self.planner.forget(replica)

    def _committed(self, step: int, epoch: int) -> bool:
        """Whether `step` committed in `epoch` (one read): its timings are in the store from its commit on,
        where `last_commit` moves only with its record, which a member stepping ahead writes after the
        next step's compute. Read at the commit, a verdict's weights reach the plan proposed at the
        next step's commit, i.e. the step after that one, instead of one step later in about half of
        the runs measured (2 replicas, one 2x slow: 2 of 5)."""
        decision = read(self.store, keys.decision(step, epoch))
        return decision is not None and decision.startswith(b"commit")

    def _timings(self, step: int, epoch: int) -> dict[int, list[MicrobatchTiming]]:
        """Every commit-epoch member's timings of `step`: (tokens, sumsq, seconds) per microbatch."""
        for e in range(epoch, -1, -1):  # the commit is usually in the newest epoch: search down
            decision = read(self.store, keys.decision(step, e))
            if decision is not None and decision.startswith(b"commit"):
                self.commit_epoch = e
                if e not in self.members:  # members/{e} never changes once written
                    self.members[e] = json.loads(self.store.get(keys.members(e)))
                members = self.members[e]
                if not self.store.check([keys.done(step, e, m) for m in members]):
                    # a group admitted in epoch e joins at the next step: it has no done record of
                    # this one (multi_get would wait for it until the store's timeout)
                    members = [m for m in members if self.store.check([keys.done(step, e, m)])]
                done = {m: json.loads(d) for m, d in zip(members, self.store.multi_get(
                    [keys.done(step, e, m) for m in members]))}
                ranks = self._rank_records(step, e, done)
                return {m: group_timings(d, ranks.get(m, [])) for m, d in done.items()}
        return {}

    def _rank_records(self, step: int, epoch: int, done: dict[int, dict]) -> dict[int, list[dict]]:
        """Ranks 1.. own records of `step` of each member whose done record says it has several ranks
        (one round trip for all). A commit needs every rank's publish, each after its record: they are
        there; a member missing one (checked first: `multi_get` would wait) is timed by its rank 0 alone,
        as a rank's place in the list says which rank it is."""
        want = [(m, keys.rank_done(step, epoch, m, j)) for m, d in done.items() for j in range(1, d.get("ranks", 1))]
        if not want:
            return {}
        if not self.store.check([k for _, k in want]):
            want = [(m, k) for m, k in want if self.store.check([k])]
        out: dict[int, list[dict]] = {}
        for (m, _), v in zip(want, self.store.multi_get([k for _, k in want]) if want else []):
            out.setdefault(m, []).append(json.loads(v))
        return {m: r for m, r in out.items() if len(r) == done[m]["ranks"] - 1}

    def _log_noise(self) -> None:
        """A `noise` record when a device class's measured noise first shows or moves by NOISE_MOVE from
        the last one logged (a few records a run: the thresholds it gives are in policy/noise.py)."""
        fleet = self.detector.fleet_noise()
        if any(c not in self.noise_logged or abs(v - self.noise_logged[c]) > NOISE_MOVE * self.noise_logged[c]
               for c, v in fleet.items()):
            self.noise_logged = fleet
            self.log.emit("noise", step=self.next_step, fleet={c: round(v, 4) for c, v in fleet.items()},
                          replicas={str(r): round(v, 4) for r, v in self.detector.noise().items()})

    def _log(self, changes: list[VerdictChange | RegimeChange]) -> None:
        for c in changes:
            if isinstance(c, VerdictChange):
                self.log.emit("verdict", step=c.step, replica=c.replica, old=str(c.old), new=str(c.new),
                              speed=round(c.speed, 4), score=round(c.score, 4), noise=round(c.noise, 4))
            else:
                self.log.emit("regime", step=c.step, device_class=c.device_class, factor=round(c.factor, 4),
                              moved=c.moved, replicas=c.replicas)
