"""Re-planning in the coordinator: the scheduler's decision for a replica group whose fail-slow verdict
turns Slow, or Healthy again after Slow, logged as a `group_plan` event, and the quota weight it leaves.

Owns: what the coordinator knows of a group's plan (`GroupShape`, from the config), the cost-model
`Setting` it calibrates from the detector's predictor (or the step's measured times), calling
`policy.scheduling.decide` and `restrict` with the options this runtime cannot execute and why, the
`group_plan` event, and which groups' quotas follow their speed afterwards (`weight_of`). Does not own:
the decision or its cost model (policy/), the detector or publishing weights (slowness.py).

What the runtime executes. For a group turning Slow or Healthy: keep (equal quotas) and reweight (the
group's quota weight is its measured speed: what --run.quotas=speed always did); under --run.quotas=drop
(ResiHP's "drop" baseline) every group declared Slow is parked instead: quota weight `PARKED`, no
microbatch of any later step (workload.assign), while it stays in the epoch reducing a zero share, so its
state stays in step. Parking is for good: a parked group computes nothing, so nothing measures it back
(the reason drop is not executable under the other settings). For a group that lost a rank
(parallel.on_rank_loss=replan, groups of pipeline stages, TP ranks, FSDP2 shards or a mix; `on_rank_lost`):
drop (its survivors leave) and shrink: onto one survivor running the whole model (standin.py), or,
for a pipeline without FSDP2, the survivors re-formed into fewer stages that merge whole stages of the
full plan, each one rank or a full TP team (runtime/trainer/replan_reform.py; `reformable` refuses other plans of
several ranks); the shrunk group's quota weight its smaller plan's. Where the run's groups cannot re-form
at all (`GroupShape.reform_refused`: a user's parallelize function sharded them, or their plan cannot say
a lost rank's slices), shrink is priced but refused with that reason, and drop applied. A Slow group whose one slow rank is located, under
parallel.on_rank_loss=replan and --run.quotas=speed, may also shrink around it onto one healthy rank
(`evictions`): the coordinator declares the group dead naming that rank, as if it were lost (its fence
ends it), and the rank-loss path above runs, the scheduler deciding again. Quotas come from
`workload.assign` either way, so every step still reduces exactly its M microbatches. Not executed, and
said so in each event:
  drop (slow)  under --run.quotas=speed|equal: a parked group is never probed back (above), so parking a
               transiently slow group would lose it for the rest of the run
  shrink (slow) without one located slow rank, onto more than one rank, or under other settings
  grow, repartition
               a live group's ranks keep their plan: only a lost (or evicted) rank's survivor re-forms
               (shrink), and a lost rank's return re-forms the group at its full plan by its torchrun restart
The runtime's detector times whole groups (each microbatch at the group's slowest rank: slowness.group_timings);
the done records also carry each rank's own device seconds, and `policy.locating` compares rank j of the
Slow group with rank j of its peers over the committed steps of the group's episode (since it left
Healthy; at most the last config detector.locate_steps): the decision is given the
slowest rank located at the group's measured speed (any other located rank in proportion, the rest
healthy), or, where none is located (a stand-in, no peer with per-rank times), every rank of the group at
the group's measured speed.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.runtime.store.reasons import EVICTED
from unbroken.policy import locating, stepcost
from unbroken.policy import replan_scheduler as scheduling
from unbroken.policy.detection import VerdictChange, Verdict
from unbroken.policy.replan_plans import Plan, aligned, full_plan
from unbroken.policy.predictor import MicrobatchTiming, Predictor
from unbroken.policy.workload import PARKED
from unbroken.topology import Topology

REFUSED = {
    "drop": "a parked group computes nothing, so nothing measures it back: parking is for good, chosen "
            "only with run.quotas=drop",
    "repartition": "moving layers changes which layers shard index j holds in this group, where the "
                   "cross-group reduction of index j needs the same layers in every group",
    "shrink": "a group re-forms a smaller plan only when it lost a rank, or around one slow rank located "
              "(policy/locating.py) onto one healthy rank, under parallel.on_rank_loss=replan and "
              "run.quotas=speed",
    "grow": "a group's plan is fixed when its torchrun job starts (it runs its full plan or is out)",
}
# A group that lost a rank (parallel.on_rank_loss=replan): dropping it, shrinking it onto one survivor
# (the whole model, every shard index: runtime/parallel/standin.py) or onto a pipeline of merged full
# stages (runtime/trainer/replan_reform.py: `reformable`) are executed; nothing else.
LOST_REFUSED = {
    "repartition": "moving layers changes which layers shard index j holds in this group, where the "
                   "cross-group reduction of index j needs the same layers in every group",
    "grow": "a lost rank comes back by its group's restart (torchrun), which rejoins at the full plan",
    "keep": "the group lost a rank",
    "reweight": "the group lost a rank",
}
# why a plan of several survivors is not executed where it is not a pipeline of whole stages of the full
# plan, computed by one rank or a TP team of the full degree, in a group without FSDP2 (`reformable`)
MULTI_RANK = ("several survivors re-form only into pipeline stages that merge whole stages of the full plan, "
              "each one rank (holding every FSDP2 shard and TP index of its stages) or a TP team of the full "
              "plan's degree (each rank every FSDP2 shard of its TP index), never sharded with FSDP2 "
              "(runtime/trainer/replan_reform.py); one survivor stands in for the whole group otherwise")


def reformable(full: Plan) -> Callable[[scheduling.Option], str | None]:
    """For `scheduling.restrict`: why a plan of several ranks cannot be executed for a group whose full
    plan is `full` (None where it can): its team members re-form a pipeline whose stage k holds whole
    stages of the full plan (policy/plans.coarsen), each stage's team either one rank holding every TP
    rank's and FSDP2 shard's slices of them (whole tensors: TP 2 -> 1, FSDP2 2 -> 1, each shard's rows
    computed in turn) or a TP team of the full plan's degree (its ranks each holding their TP index's
    shard indices of them, every FSDP2 shard's). No other TP or FSDP2 degree: its slices would cut other
    heads or rows than shard index j holds in the peer groups."""
    def unable(o: scheduling.Option) -> str | None:
        if o.plan is None or len(o.plan.ranks) <= 1:
            return None
        if o.plan.shard > 1 or o.plan.tp not in (1, full.tp) or not aligned(o.plan, full):
            return MULTI_RANK
        return None
    return unable
EQUAL = "run.quotas=equal: quotas never follow speed"  # why reweight is refused too under that setting
DROP = "run.quotas=drop: a group declared Slow is parked (ResiHP's drop baseline)"  # why the others are refused
MEASURED_MIN, MEASURED_MAX = 0.1, 4.0  # the quota weight a shrunk group's measured speed may take (`measured`)
QUOTAS = ("speed", "equal", "drop")  # config run.quotas: what a Slow group's quota becomes
@dataclass(frozen=True)
class GroupShape:
    """What the coordinator knows of every replica group's plan and model, from the run's config."""
    group_size: int  # ranks per group
    tp: int  # tensor-parallel degree inside a group
    pp: int  # pipeline stages inside a group
    layers: int  # transformer blocks (config model.n_layer)
    width: int  # model.n_embd: a block holds ~12 width^2 parameters
    microbatches: int  # M, per step
    steps: int  # the run's steps: the horizon a slow episode's plan is spread over (its end is unknown)
    reform_seconds: float = 2.0  # config hardware.reform_seconds: the cost model's one-off re-form time
    evict: int = 0  # 1: a group may shrink around a located slow rank (parallel.on_rank_loss=replan)
    # the rest of config [hardware]: the cost model's link speeds and state budget (stepcost.Hardware)
    tp_bytes_per_s: float = stepcost.Hardware.tp_bytes_per_s
    pp_bytes_per_s: float = stepcost.Hardware.pp_bytes_per_s
    peer_bytes_per_s: float = stepcost.Hardware.peer_bytes_per_s
    state_budget_bytes: float = stepcost.Hardware.state_budget_bytes
    # config detector.locate_steps: committed steps whose per-rank times locate a Slow group's slow rank
    # (the detector's evidence for a verdict spans about as many steps), of those since the group left
    # Healthy: a step before the episode dilutes it, and a warm-up step outweighs several
    locate_steps: int = 4
    # why a group that loses a rank cannot re-form onto fewer ranks (api.check_host: a user's parallelize
    # function sharded it, or its plan cannot say a lost rank's slices: model/plan.reform_problem); None:
    # it can. Where set, `on_rank_lost` prices shrink and applies drop, naming this in `not_executable`
    reform_refused: str | None = None

    def hardware(self) -> stepcost.Hardware:
        return stepcost.Hardware(tp_bytes_per_s=self.tp_bytes_per_s, pp_bytes_per_s=self.pp_bytes_per_s,
                                 peer_bytes_per_s=self.peer_bytes_per_s,
                                 state_budget_bytes=self.state_budget_bytes, reform_seconds=self.reform_seconds)


def group_shape(cfg: Config) -> GroupShape:
    """The run's groups as the coordinator needs them (launch.py passes its fields as --plan)."""
    p, h = cfg.parallel, cfg.hardware
    return GroupShape(p.group_size, p.tp, p.pp, cfg.model.n_layer, cfg.model.n_embd, cfg.run.microbatches,
                      cfg.run.steps, float(h.reform_seconds), int(p.on_rank_loss == "replan"),
                      float(h.tp_bytes_per_s), float(h.pp_bytes_per_s), float(h.peer_bytes_per_s),
                      float(h.state_budget_bytes), cfg.detector.locate_steps)


def plan_arg(shape: GroupShape) -> str:
    """The coordinator's --plan argument: every numeric field of `shape` but group_size (passed apart), in
    order, comma-separated; `parse_shape` reads it back. reform_refused travels as its own argument."""
    return ",".join(str(getattr(shape, f.name)) for f in fields(shape)[1:] if f.name != "reform_refused")


def parse_shape(group_size: int, plan: str, reform_refused: str | None = None) -> GroupShape:
    """The GroupShape that `plan_arg` wrote, with `group_size` and `reform_refused`."""
    values = (int(v) if v.lstrip("-").isdigit() else float(v) for v in plan.split(","))
    return GroupShape(group_size, *values, reform_refused=reform_refused)


def planner_for(shape: GroupShape | None, replicas: int, log: EventLog, quotas: str) -> GroupPlanner | None:
    """A planner for the run's groups (TP x FSDP2 x PP, one-rank groups included), else None: no shape
    given, or fewer layers than stages (quota weights then follow speed as before). `quotas` is config
    run.quotas (one of QUOTAS)."""
    if shape is None:
        return None
    topology = Topology(replicas, shape.group_size, shape.group_size, tp=shape.tp, pp=shape.pp)
    if shape.layers < shape.pp:
        return None
    return GroupPlanner(shape, full_plan(topology, shape.layers), log, quotas)


class GroupPlanner:
    """Call `on_verdicts(changes, timings, predictor, members)` with each committed step's verdict changes;
    `weight_of(group, speed)` for the quota weight a group's measured speed becomes."""

    def __init__(self, shape: GroupShape, full: Plan, log: EventLog, quotas: str):
        if quotas not in QUOTAS:
            raise ValueError(f"quotas={quotas!r}: expected one of {QUOTAS}")
        self.shape, self.full, self.log = shape, full, log
        self.quotas = quotas
        self.reweighted: dict[int, float] = {}  # group -> its speed when its applied option was reweight
        self.parked: set[int] = set()  # groups whose applied option was drop (run.quotas=drop): for good
        self.shrunk: dict[int, Plan] = {}  # group -> the plan it runs after losing a rank (shrink applied)
        self.was_shrunk: dict[int, Plan] = {}  # shrunk groups since declared dead (their ranks may be back)
        self.evicting: dict[int, str] = {}  # group -> why its located slow rank leaves (`evictions`)
        self.timings: Mapping[int, Sequence[MicrobatchTiming]] = {}  # the last committed step's
        self.recent: deque[tuple[int, Mapping[int, Sequence[MicrobatchTiming]]]] = deque(maxlen=shape.locate_steps)
        self.observed = 0  # committed steps observed: the index `recent` pairs each step's timings with
        self.episode: dict[int, int] = {}  # group -> index of the step it left Healthy in (while not Healthy)

    def weight_of(self, group: int, speed: float) -> float:
        """`speed` while the group's last applied option is reweight; PARKED once dropped; a shrunk
        group's plan weight (the cost model's predicted speed of its smaller plan); else 1.0 (keep)."""
        if group in self.parked:
            return PARKED
        if group in self.reweighted:
            return speed
        return self.shrunk[group].weight if group in self.shrunk else 1.0

    def resume(self, published: Mapping[int, float], shrunk: Mapping[int, Plan] | None = None) -> None:
        """A coordinator taking over: `shrunk` (the store's `keys.shrunk`, as `shrunk_plans` left it) runs its
        smaller plans; the other groups whose published weight is below 1 were reweighted by the leader
        before, and those published as PARKED were dropped (their decisions are in the event log already;
        they are not made again)."""
        self.shrunk = dict(shrunk or {})
        self.parked = {g for g, w in published.items() if w == PARKED}
        self.reweighted = {g: w for g, w in published.items()
                           if w < 1.0 and g not in self.shrunk and g not in self.parked}

    def measured(self, group: int, speed: float | None) -> float | None:
        """A shrunk group's measured speed relative to its peers (`group_plan_measured`, replan_measure.py)
        becomes its quota weight under run.quotas=speed, in place of the cost model's prediction: its
        quota follows its new speed. Returns the weight set, or None where nothing changes (other quota
        settings; a group not running shrunk, or reweighted or parked by the detector since). Clamped to
        [MEASURED_MIN, MEASURED_MAX]: one measurement over 3 steps of a noisy host must not zero a group
        or hand it every microbatch. Call once per measurement, before the step's weights are published."""
        if (self.quotas != "speed" or speed is None or group not in self.shrunk or group in self.reweighted
                or group in self.parked):
            return None
        weight = round(min(max(speed, MEASURED_MIN), MEASURED_MAX), 2)
        self.shrunk[group] = replace(self.shrunk[group], weight=weight)
        return weight

    def shrunk_plans(self) -> dict[int, Plan]:
        """Every group shrunk and not yet back at its full plan (running shrunk, or declared dead since):
        what the coordinator keeps in the store for a successor (`resume`). Read after each change."""
        return {**self.was_shrunk, **self.shrunk}

    def observe(self, timings: Mapping[int, Sequence[MicrobatchTiming]]) -> None:
        """A committed step's timings that need no decision (a taking-over coordinator's replay): they
        price a later rank loss. `on_verdicts` takes them itself."""
        self.timings = timings
        self.recent.append((self.observed, timings))
        self.observed += 1

    def _episode(self, group: int) -> list[Mapping[int, Sequence[MicrobatchTiming]]]:
        """The recent committed steps' timings since `group` left Healthy (all of `recent` where the planner
        did not see it leave: a coordinator that took over mid-episode)."""
        start = self.episode.get(group, -1)
        return [t for i, t in self.recent if i >= start]

    def forget(self, group: int) -> None:
        """A group declared dead comes back with a fresh detector record and its full plan."""
        self.reweighted.pop(group, None)
        self.parked.discard(group)
        self.episode.pop(group, None)
        if group in self.shrunk:
            self.was_shrunk[group] = self.shrunk.pop(group)

    def on_rank_lost(self, group: int, alive: Sequence[int], step: int, members: Sequence[int],
                     predictor: Predictor) -> scheduling.Restricted | None:
        """A group lost ranks (its survivors, `alive`, ask to go on without them): the scheduler's choice
        between dropping it and shrinking it onto them, logged as a `group_plan` event. Returns the
        restricted decision (its `applied.kind` is "shrink" or "drop"), or None when the cost model
        cannot be set up (logged: the group is then dropped). Call once per request, after its old
        incarnation was declared dead (`forget`), with the members that stay. `alive`: every survivor
        that claimed (reform.agree); the plan applied names the ones that go on (its teams)."""
        setting, source, seconds = self._setting(self.timings, predictor)
        if setting is None:
            self.log.emit("group_plan_skipped", step=step, replica=group, why=source)
            return None
        plans = {g: replace(self.full, weight=self.reweighted.get(g, 1.0)) for g in members if g != group}
        plans.update({g: p for g, p in self.shrunk.items() if g in plans})
        plans[group] = self.full
        speeds = {g: {k: v for k in self.full.ranks} for g, v in self.reweighted.items() if g in plans}
        horizon = max(1.0, float(self.shape.steps - step))
        d = scheduling.decide(group, plans, self.full, frozenset(alive), speeds, setting, horizon,
                              peers=len(plans) > 1)
        refused = {**LOST_REFUSED, **({"shrink": self.shape.reform_refused} if self.shape.reform_refused else {})}
        r = scheduling.restrict(d, refused, reformable(self.full))
        if r.applied.kind == "shrink":
            self.shrunk[group] = r.applied.plan
        # what the change does to the trajectory (docs/replanning.md): a pipeline's stages re-joined on one rank compute
        # every microbatch's gradients with the same kernels, so --exact stays bitwise, and so do FSDP2
        # shards (one rank computes each shard's rows as that shard did, and --exact sums them in float64);
        # a TP team kept whole (its degree unchanged) runs the same kernels too; TP 2 -> 1 adds over all
        # heads and units at once where the ranks added partial sums, and FSDP2
        # inside stages adds the tied weight's two uses per batch in float64 where one model adds them per
        # microbatch in float32 (pipeline._sum_tied_shards; a re-formed pipeline of several ranks hands
        # its stages' parts over apart, to the same float64 sum: Stages(apart=True)); a drop changes nothing
        full, applied = self.full, r.applied.plan
        exact = r.applied.kind != "shrink" or (applied.tp == full.tp and (full.pp == 1 or full.shard == 1
                                                                         or len(applied.ranks) > 1))
        self.log.emit("group_plan", step=step, replica=group, why="rank lost", alive=sorted(alive),
                      per_microbatch_seconds=round(seconds, 6), cost_source=source,
                      trajectory="bitwise (the same kernels per microbatch)" if exact else
                      "within float32 tolerance (a TP degree change, or FSDP2 leaving pipeline stages, reorders "
                      "float32 sums)", **r.record())
        return r

    def on_ranks_back(self, group: int, step: int, members: Sequence[int], predictor: Predictor
                      ) -> scheduling.Restricted | None:
        """A group that ran shrunk rejoins with every rank (its replaced rank's agent re-formed it at its full
        plan): the scheduler's view of that change, logged as a `group_plan` event (`why: "ranks back"`);
        what it executed is the grow (the full group healed from a peer and admitted). Returns the
        restricted decision, or None when the group had not run shrunk or the cost model cannot be set
        up (nothing logged then). Call at admission."""
        # a coordinator that took over knows a group declared dead before it led as shrunk, not was_shrunk
        before = self.was_shrunk.pop(group, None) or self.shrunk.pop(group, None)
        setting, source, seconds = self._setting(self.timings, predictor)
        if before is None or setting is None:
            return None
        plans = {g: replace(self.full, weight=self.reweighted.get(g, 1.0)) for g in members if g != group}
        plans.update({g: p for g, p in self.shrunk.items() if g in plans})
        plans[group] = before
        d = scheduling.decide(group, plans, self.full, self.full.ranks, {}, setting,
                              max(1.0, float(self.shape.steps - step)), peers=len(plans) > 1)
        r = scheduling.restrict(d, {k: why for k, why in LOST_REFUSED.items() if k != "grow"})
        self.log.emit("group_plan", step=step, replica=group, why="ranks back", alive=sorted(self.full.ranks),
                      per_microbatch_seconds=round(seconds, 6), cost_source=source, **r.record())
        return r

    def on_verdicts(self, changes: Sequence[VerdictChange], timings: Mapping[int, Sequence[MicrobatchTiming]],
                    predictor: Predictor, members: Sequence[int]) -> list[tuple[int, str, scheduling.Restricted]]:
        """Decide for each group entering Slow or leaving it; log one `group_plan` event each. Call with
        every committed step (changes or not): its timings price a later rank loss too. Returns (group,
        why, decision) of each decision logged, for the caller to measure."""
        self.observe(timings)
        decided = []
        for c in changes:
            if c.old is Verdict.HEALTHY:  # an episode begins with this step
                self.episode[c.replica] = self.observed - 1
            elif c.new is Verdict.HEALTHY:
                self.episode.pop(c.replica, None)
            if (c.new is Verdict.SLOW) == (c.old is Verdict.SLOW):
                continue  # Healthy <-> Suspect: nothing to decide
            setting, source, seconds = self._setting(timings, predictor)
            if setting is None:
                self.log.emit("group_plan_skipped", step=c.step, replica=c.replica, why=source)
                continue
            slow = c.new is Verdict.SLOW
            speed = c.speed if slow else 1.0
            # others keep the quota weight in force; the group's slow ranks located if they can be, else
            # every rank of it at the group's speed
            ranks = locating.rank_speeds(c.replica, self._episode(c.replica)) if slow else {}
            located = locating.slow_ranks(ranks)
            plans = {g: replace(self.full, weight=self.reweighted.get(g, 1.0)) for g in members if g != c.replica}
            plans.update({g: p for g, p in self.shrunk.items() if g in plans})
            plans[c.replica] = self.shrunk.get(c.replica, self.full)
            speeds = {g: {k: v for k in self.full.ranks} for g, v in self.reweighted.items() if g in plans}
            # the slowest located rank at the group's speed (the detector's estimate, over its own window),
            # any other located rank at its ratio to that one
            slowest = min(located.values(), default=1.0)
            speeds[c.replica] = {j: min(1.0, speed * v / slowest) for j, v in located.items()} if located else \
                ({k: speed for k in self.full.ranks} if speed < 1.0 else {})
            alive, extra = self.full.ranks, {}
            if c.replica in self.shrunk:  # a stand-in: the detector holds it against full groups, where its
                # plan was expected to give `weight` of one; its device is slow only below that
                plan = self.shrunk[c.replica]
                device = min(1.0, speed / plan.weight)
                alive, extra = plan.ranks, {"shrunk": True, "device_speed": round(device, 4)}
                speeds[c.replica] = {k: device for k in plan.ranks} if device < 1.0 else {}
            horizon = max(1.0, float(self.shape.steps - c.step))
            d = scheduling.decide(c.replica, plans, self.full, alive, speeds, setting, horizon,
                                  peers=len(plans) > 1)
            r = scheduling.restrict(d, self._refused(slow, located, d))
            if r.applied.kind == "shrink":  # executed as the located rank's loss (on_rank_lost decides again)
                (j,) = located
                self.evicting[c.replica] = f"rank {j}: {EVICTED} (speed {speeds[c.replica][j]:.2f})"
            if r.applied.kind == "reweight":
                self.reweighted[c.replica] = speed
            else:
                self.reweighted.pop(c.replica, None)
            if r.applied.kind == "drop":
                self.parked.add(c.replica)
            why = "slow" if slow else "healthy again"
            self.log.emit("group_plan", step=c.step, replica=c.replica, why=why, speed=round(speed, 4),
                          located=sorted(located), rank_speeds={str(j): round(v, 4) for j, v in sorted(ranks.items())},
                          per_microbatch_seconds=round(seconds, 6), cost_source=source, **extra, **r.record())
            decided.append((c.replica, why, r))
        return decided

    def evictions(self) -> dict[int, str]:
        """The groups whose decision since the last call was to shrink around their located slow rank, each
        with the reason to declare it dead under ("rank J: ...", as a lost rank's: its other ranks survive
        and ask to go on shrunk; rank J's fence ends it). Call after `on_verdicts`, once per round."""
        out, self.evicting = self.evicting, {}
        return out

    def _refused(self, slow: bool, located: Mapping[int, float] | None = None,
                 d: scheduling.Decision | None = None) -> dict[str, str]:
        """What a Slow (or Healthy-again) decision `d` may not apply, and why, under config run.quotas. A
        shrink is executable around one `located` slow rank of a group that can shrink (GroupShape.evict)
        when every shrink candidate keeps one rank, not that one: the runtime then declares that rank lost,
        and the group's survivor goes on as the whole group (standin.py)."""
        if self.quotas == "drop" and slow:
            return {k: DROP for k in scheduling.KINDS if k != "drop"}
        refused = {**REFUSED, **({} if self.quotas == "speed" else {"reweight": EQUAL if self.quotas == "equal" else DROP})}
        if self.shape.reform_refused:  # the group could not go on shrunk without the evicted rank
            return {**refused, "shrink": self.shape.reform_refused}
        shrinks = [o.plan for o in (d.options if d else ()) if o.kind == "shrink"]
        if (slow and self.shape.evict and self.quotas == "speed" and located and len(located) == 1 and shrinks
                and all(len(p.ranks) == 1 and not p.ranks & set(located) for p in shrinks)):
            del refused["shrink"]
        return refused

    def _setting(self, timings: Mapping[int, Sequence[MicrobatchTiming]], predictor: Predictor
                 ) -> tuple[stepcost.Setting | None, str, float]:
        """The cost model calibrated to a healthy group's microbatch: the predictor's for the step's mean
        microbatch when it is fitted, else the median measured microbatch of the step."""
        mbs = [m for ms in timings.values() for m in ms]
        if not mbs:
            return None, "no timings for the step", 0.0
        tokens = statistics.fmean(m.tokens for m in mbs)
        sumsq = statistics.fmean(m.sumsq for m in mbs)
        if predictor.ready():
            seconds, source = predictor.predict(tokens, sumsq), "predictor"
        else:
            seconds, source = statistics.median(m.seconds for m in mbs), "measured median"
        w = self.shape.width
        # fp32 weights, gradient and two Adam moments: 16 B per parameter, of which FSDP2 gathers the 4 B
        # weight; the activation a stage boundary sends is width float32s per token. Hardware: config
        # [hardware], stated H100 figures by default, not this machine's: a shrink's state pull and the
        # state budget that decides whether a stand-in fits are an H100 cluster's.
        model = stepcost.ModelShape(self.shape.layers, 12 * w * w * 16.0, 4.0 * w, 12 * w * w * 4.0)
        hardware = self.shape.hardware()
        try:
            return stepcost.calibrate(seconds, self.full, model, hardware, max(1, round(tokens)),
                                      self.shape.microbatches), source, seconds
        except ValueError as e:
            return None, str(e), seconds
