"""Re-planning a replica group (ResiHP's scheduler): when it loses a rank, a rank turns slow, or a lost
rank returns, which plan it should run, chosen by predicted step time.

Owns: the candidate plans of one group (`options`) and the choice among them (`decide`), each with its
predicted step time, its one-off re-plan cost and the state it moves, as a frozen `Decision` that the
runtime logs as a `group_plan` event and the simulator applies. Candidates:
  drop         the group leaves the step (parallel.on_rank_loss=drop; the baseline every other option must beat)
  keep         the current plan as it is (only while all its ranks live: "report, do not act")
  reweight     the current plan, its quota weight set to its predicted speed
  repartition  the same ranks and degrees, layers moved off a slow stage
  shrink       fewer ranks: fewer pipeline stages (layers re-partitioned), a smaller TP degree and/or
               no FSDP2, missing shards pulled from the matching ranks of a live peer group
  grow         more ranks, up to the full plan, when lost ranks are back
Does not own: the cost model (stepcost.py), plan shapes (policy/replan_plans.py), detecting faults, moving state.

`restrict` is the runtime's view of a decision: the option it applies among those it can execute, beside
the choice and the reasons the others were not executable (runtime/coordinator/replan.py lists what it
executes: keep and reweight for a slow group, drop it under run.quotas=drop, and for a group that lost a
rank drop, or shrink onto one survivor or onto a pipeline of merged full stages; a live group's layer
split is not).

Quotas are always `workload.assign(M, groups, weights)`: whatever plan is chosen, the step's
microbatches (s, 0..M-1) are each assigned exactly once, and the global batch never changes.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from unbroken.policy import replan_plans as P
from unbroken.policy import stepcost as C

KINDS = ("grow", "keep", "reweight", "repartition", "shrink", "drop")  # also the order that breaks ties


@dataclass(frozen=True)
class Option:
    kind: str  # one of KINDS
    plan: P.Plan | None  # None: the group is dropped from the step
    step_seconds: float  # predicted step time of the whole job under this option, s
    replan_seconds: float  # one-off: re-form + the slowest receiver's state pull, s
    moved_bytes: float  # state all receiving ranks pull together, bytes
    amortised_seconds: float  # step_seconds + replan_seconds / horizon_steps: what is compared, s
    owners: tuple[int, ...]  # owners[i] = the group computing microbatch i of the step

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "plan": self.plan.shape() if self.plan else None,
                "weight": round(self.plan.weight, 4) if self.plan else 0.0,
                "step_seconds": round(self.step_seconds, 6), "replan_seconds": round(self.replan_seconds, 6),
                "moved_bytes": round(self.moved_bytes), "amortised_seconds": round(self.amortised_seconds, 6)}


@dataclass(frozen=True)
class Decision:
    group: int
    chosen: Option
    options: tuple[Option, ...]  # every feasible candidate, in generation order (chosen among them)
    horizon_steps: float

    def record(self) -> dict[str, Any]:
        """Fields of a `group_plan` event: the decision, its predicted cost, the state moved, the others."""
        c = self.chosen
        return {"group": self.group, "decision": c.kind, "plan": c.plan.shape() if c.plan else None,
                "teams": [list(team) for team in c.plan.teams] if c.plan else [],
                "predicted_step_seconds": round(c.step_seconds, 6), "replan_seconds": round(c.replan_seconds, 6),
                "moved_bytes": round(c.moved_bytes), "horizon_steps": self.horizon_steps,
                "options": [o.record() for o in self.options]}


def options(group: int, plans: Mapping[int, P.Plan], full: P.Plan, alive: Collection[int],
            speeds: Mapping[int, Mapping[int, float]], s: C.Setting, horizon_steps: float,
            peers: bool = True) -> list[Option]:
    """Every feasible candidate for `group`, each priced (see `decide` for the arguments)."""
    alive = frozenset(alive)
    current = plans.get(group)
    mine = speeds.get(group, {})
    others = {g: p for g, p in plans.items() if g != group}
    sufficient = C.self_sufficient(current, alive, full)
    # What the group's ranks hold is current only if the group kept stepping. One that lost a rank left
    # the step it was in (its microbatches are redone elsewhere; its survivors leave the cross-group
    # reduction), so its survivors' state misses that step's update and every rank of a re-formed plan
    # pulls its whole holding, not only what it lacks.
    held = current if current is not None and current.ranks <= alive else None
    out: list[Option] = []

    def price(kind: str, plan: P.Plan | None, reform: bool) -> None:
        moved = C.moved_bytes(held, plan, alive, full, s)
        if moved and not (peers or sufficient):
            return  # the missing state is held by no survivor and there is no peer group to pull it from
        pull = max(moved.values(), default=0.0) / s.hardware.peer_bytes_per_s
        cost = (s.hardware.reform_seconds if reform else 0.0) + pull
        trial = dict(others) if plan is None else {**others, group: plan}
        step, owners = C.step_seconds(trial, speeds, s)
        out.append(Option(kind, plan, step, cost, sum(moved.values()), step + cost / horizon_steps, owners))

    price("drop", None, current is not None)
    healthy = full.ranks <= alive and all(mine.get(r, 1.0) >= 1.0 for r in full.ranks)
    if healthy:
        # every rank back and healthy: the full plan is the user's, sized and tuned on real hardware, and
        # the model's chosen constants never override it (nor keep a shrunk plan it happens to favour)
        if current != full:
            price("grow", full, True)
        else:
            price("keep", full, False)
        return out
    if current is not None and current.ranks <= alive:
        price("keep", current, False)
        earned = C.rate(current, mine, full, s)
        if abs(earned - current.weight) > 1e-12 * earned:  # else it is "keep" again
            price("reweight", replace(current, weight=earned), False)
    for plan in reshapes(full, alive, mine, s):
        n = len(current.ranks) if current is not None else 0
        if current is not None and (plan.tp, plan.teams) == (current.tp, current.teams):
            kind = "repartition"
        else:
            kind = "shrink" if len(plan.ranks) < n else "grow" if len(plan.ranks) > n else "repartition"
        if plan != current:
            price(kind, plan, True)
    return out


def reshapes(full: P.Plan, alive: Collection[int], speeds: Mapping[int, float], s: C.Setting) -> list[P.Plan]:
    """Every plan the survivors can run: each TP degree dividing the full one, each number of stages
    up to the full plan's and what the survivors' teams fill (the fastest teams kept), layers
    partitioned by stage speed within each rank's state budget, freely and as whole stages of the full
    plan merged (`plans.coarsen`) where that differs; quota weight = the plan's predicted speed. Never
    more stages or a larger TP degree than the full plan (its activation memory and host layout are what
    the user sized). Deterministic."""
    out = []
    tp = full.tp
    while tp >= 1:
        if full.tp % tp == 0:
            pool = P.teams(full, alive, tp, speeds)
            fastest = sorted(range(len(pool)), key=lambda i: (-min(speeds.get(r, 1.0) for r in pool[i]), i))
            cap = int(s.hardware.state_budget_bytes // (s.model.state_bytes_per_layer / tp))
            for pp in range(1, min(len(pool), full.pp) + 1):
                chosen = [pool[i] for i in sorted(fastest[:pp])]  # kept in host order along the pipeline
                team_speed = [min(speeds.get(r, 1.0) for r in t) for t in chosen]
                per_layer = [C.per_layer_seconds(tp, v, s) for v in team_speed]
                fixed, caps = [C.pp_comm(pp, s)] * pp, [cap] * pp
                free = P.partition(full.layers, per_layer, fixed, caps)
                merged = P.coarsen(full.stages, pp, per_layer, fixed, caps)
                # the free split balances best; whole old stages merged (`coarsen`) is what keeps shard
                # index j's layers those of every group's index j: both are offered when they differ
                for stages in dict.fromkeys(x for x in (free, merged) if x is not None):
                    plan = P.Plan(tp, stages, tuple(chosen))
                    out.append(replace(plan, weight=C.rate(plan, speeds, full, s)))
        tp -= 1
    return out


def decide(group: int, plans: Mapping[int, P.Plan], full: P.Plan, alive: Collection[int],
           speeds: Mapping[int, Mapping[int, float]], s: C.Setting, horizon_steps: float,
           peers: bool = True) -> Decision:
    """The plan `group` should run from the next step boundary on.

    Call when the group loses ranks (heartbeats declared them dead), when the detector declares one of
    its ranks Slow or Healthy again, or when a lost rank is back (healed, waiting at a step boundary).
      plans          current plan of every group in the step; `group`'s own (its plan before the
                     change) may be absent if it is out; others keep theirs while this one is decided
      full           the group's full plan (`plans.full_plan(topology, layers)`)
      alive          ranks of `group` that are alive now
      speeds         group -> rank -> speed (1.0 healthy; missing = 1.0), the detector's estimates
      horizon_steps  steps the new plan is expected to last (until the next change: a replacement's
                     arrival, an episode's end); the re-plan cost is spread over them. > 0
      peers          whether a live peer group can serve missing shards
    Returns the option of least amortised step time (ties: the order of KINDS), so the chosen option is
    never predicted worse than dropping the group. With every rank alive and healthy the only options
    are the full plan and drop: a group whose ranks are back grows back to its full plan. Raises ValueError for horizon_steps <= 0.
    """
    if not horizon_steps > 0:
        raise ValueError(f"horizon_steps must be > 0, got {horizon_steps}")
    opts = options(group, plans, full, alive, speeds, s, horizon_steps, peers)
    best = min(opts, key=lambda o: (o.amortised_seconds, KINDS.index(o.kind)))
    return Decision(group, best, tuple(opts), horizon_steps)


@dataclass(frozen=True)
class Restricted:
    """A decision as an executor that can run only some kinds of option applies it."""
    decision: Decision  # the scheduler's choice among every candidate
    applied: Option  # the least amortised step time among the executable candidates
    not_executable: tuple[tuple[str, str], ...]  # (kind, why) of each candidate the executor cannot run

    def record(self) -> dict[str, Any]:
        """`Decision.record()` plus `applied` (its kind, plan, teams and quota weight) and `not_executable`
        (kind, or kind and plan shape -> why)."""
        a = self.applied
        return {**self.decision.record(), "applied": a.kind, "applied_plan": a.plan.shape() if a.plan else None,
                "applied_teams": [list(team) for team in a.plan.teams] if a.plan else [],
                "applied_weight": round(a.plan.weight, 4) if a.plan else 0.0,
                "not_executable": {kind: why for kind, why in self.not_executable}}


def restrict(decision: Decision, refused: Mapping[str, str],
             unable: Callable[[Option], str | None] | None = None) -> Restricted:
    """The option to apply when the executor cannot run the kinds in `refused` (kind -> why not), nor
    the candidates for which `unable(option)` gives a reason (a plan of a kind it runs in some shapes).

    Call with a `decide` result; every candidate whose kind is in `refused` is listed (once per kind) in
    `not_executable`, each one `unable` refuses under "kind plan", and the rest compete as in `decide`
    (least amortised step time, ties by KINDS). Raises ValueError when no candidate is executable
    (`keep` always is while every rank of the group's current plan lives, so an executor that can keep
    never sees it then)."""
    unknown = set(refused) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown option kinds {sorted(unknown)}")
    why = {}
    for o in decision.options:
        if o.kind in refused:
            why.setdefault(o.kind, refused[o.kind])
        elif unable is not None and (reason := unable(o)) is not None:
            why[f"{o.kind} {o.plan.shape() if o.plan else ''}".strip()] = reason
    able = [o for o in decision.options if o.kind not in refused and (unable is None or unable(o) is None)]
    if not able:
        raise ValueError(f"no executable option among {[o.kind for o in decision.options]}")
    best = min(able, key=lambda o: (o.amortised_seconds, KINDS.index(o.kind)))
    return Restricted(decision, best, tuple(why.items()))
