"""unbroken with ResiHP-style re-planning: the real scheduler (`unbroken.policy.replan_scheduler.decide`) picks each
replica group's plan when it loses ranks, when a rank of it is declared Slow or Healthy again, and when its
lost ranks are back.

Owns: the group plans of a simulated run, calling the scheduler at those moments with what the runtime
would know (dead ranks from heartbeats, speeds from the fail-slow detector), logging each decision as a
`group_plan` event (the decision, every candidate's predicted step time and re-plan cost, the state moved),
and applying it: quotas follow each plan's weight through `workload.assign`, so every step still reduces
all M microbatches. Does not own: the scheduler or its cost model (policy/), the detector feeding
(detect.py), in-step recovery (live.py).

The simulated step time comes from the same cost model (policy/stepcost.py) evaluated with the *true*
speeds, while decisions use the detector's estimates; the model is calibrated so that the full plan on
healthy ranks takes the scenario's failure-free step, whatever the bubble, so every strategy starts from
the same step time. Simplifications (in run_start):
- a group that shrinks after a fail-stop sits out the step in flight (in-step recovery redoes its
  microbatches), re-forms and pulls its missing shards while the others go on, and rejoins at a step
  boundary where everyone re-forms (reform_seconds), as a rejoin does;
- a re-plan for a slow rank, and a grow-back when replaced ranks are usable, stall the whole job for the
  chosen option's re-plan cost at the next step boundary;
- the detector is fed each group's slowest live rank's device time (per-rank timings), so it follows the
  device, not the plan, and a Slow verdict is pinned on that rank; the runtime's detector times whole groups;
- a group dropped for a Slow rank is probed off the step: it is seen healthy `recover_steps` steps after
  its episode ends, heals from a peer (rejoin_seconds) and rejoins at a step boundary;
- the step in flight at a fail-stop is recovered with live.py's timing (each group at its slowest rank's
  factor, whatever its plan).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

from unbroken.policy import replan_scheduler as scheduling
from unbroken.policy import stepcost
from unbroken.policy.detection import Verdict
from unbroken.policy.replan_plans import Plan, full_plan
from unbroken.sim.cluster import Fault
from unbroken.sim.strategies.detect import LiveDetect
from unbroken.topology import Topology

GB = 1e9


class Replan(LiveDetect):
    name = "unbroken_replan"
    replans = True

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        c, w, m = self.sc.cluster, self.sc.workload, self.sc.model
        self.topology = Topology(c.dp, c.replica_gpus, c.gpus_per_node, tp=c.tp, pp=c.pp)
        self.full = full_plan(self.topology, m.layers)
        q = max(self.full_quotas.values())
        hw = stepcost.Hardware(m.tp_gb_per_s * GB, m.pp_gb_per_s * GB, m.pp_gb_per_s * GB,
                               m.state_budget_gb * GB, self.costs.reform_seconds)
        shape = stepcost.ModelShape(m.layers, m.state_gb_per_layer * GB, m.activation_bytes_per_token)
        # the scenario's microbatch_seconds is a group's time per microbatch at its failure-free quota, the
        # pipeline's fill and drain included: q of them take q * microbatch_seconds
        per_mb = q * w.microbatch_seconds / (q + self.full.pp - 1)
        self.setting = stepcost.calibrate(per_mb, self.full, shape, hw, w.tokens_per_microbatch, self.M,
                                          w.sync_seconds)
        self.plans: dict[int, Plan] = {r: self.full for r in range(self.R)}
        self.dead: dict[int, set[int]] = defaultdict(set)  # group -> ranks dead until replaced
        self.rank_slow: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.returns: dict[int, float] = {}  # shrunk group -> when its replaced ranks are usable, s
        self.acted: dict[int, bool] = {}  # group -> whether its plan now routes around a Slow rank
        self.token: dict[int, int] = defaultdict(int)  # group -> decisions so far (stale events ignored)
        self.decisions = 0
        self.slow_out: set[int] = set()  # groups dropped for a Slow rank, out until it is healthy
        self.engine.on("regroup", self._on_regroup)
        self.engine.on("slow_back", self._on_slow_back)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "scheduler": "unbroken.policy.replan_scheduler.decide",
                "full_plan": self.full.shape(), "device_seconds": round(self.setting.work.device_seconds, 6),
                "hardware": asdict(self.setting.hardware), "replan_simplifications": [
                    "a group shrunk after a fail-stop sits out the step in flight, re-plans while the others go "
                    "on, and rejoins at a step boundary (everyone re-forms)",
                    "re-plans for slow ranks and grow-backs stall the whole job for their re-plan cost",
                    "the detector sees each group's slowest live rank (per-rank timings); the Slow rank is "
                    "located exactly",
                    "a group dropped for a Slow rank is seen healthy recover_steps steps after its episode "
                    "ends, then heals (rejoin_seconds) and rejoins (the runtime parks it for good: "
                    "run.quotas=drop, nothing measures a parked group back)",
                    "the step in flight at a fail-stop is recovered at each group's slowest rank's factor"]}

    def end_fields(self) -> dict[str, Any]:
        return {**super().end_fields(), "replans": self.decisions}

    # ---- what the simulated step costs ---------------------------------------------------------------
    def true_speeds(self, r: int) -> dict[int, float]:
        return {k: 1.0 / max(v) for k, v in self.rank_slow.get(r, {}).items() if v}

    def plan(self, members: tuple[int, ...]) -> tuple[float, int]:
        """The cost model on the true speeds, quotas by each plan's weight: all M microbatches."""
        step, _ = stepcost.step_seconds({r: self.plans[r] for r in members},
                                        {r: self.true_speeds(r) for r in members}, self.setting)
        return step, self.M

    def sync_weights(self) -> None:
        w = {r: p.weight for r, p in self.plans.items()}
        self.weights = None if all(v == 1.0 for v in w.values()) else w

    # ---- deciding ------------------------------------------------------------------------------------
    def decide(self, t: float, r: int, speeds: dict[int, float], until: float, why: str) -> scheduling.Decision:
        plans = {g: self.plans[g] for g in self.members if g != r} | {r: self.plans[r]}
        alive = self.full.ranks - self.dead[r]
        horizon = max(1.0, (until - t) / self.t_full)  # steps the plan should last
        peers = any(g != r for g in self.members)
        d = scheduling.decide(r, plans, self.full, alive, {r: speeds}, self.setting, horizon, peers)
        self.decisions += 1
        self.token[r] += 1
        self.log.emit("group_plan", t, step=self.step, replica=r, why=why, **d.record())
        return d

    def interrupt(self, t: float, f: Fault) -> None:
        for r in f.replicas:
            if r in self.slow_out:  # out for slowness, now losing ranks: out until replaced instead
                self.slow_out.discard(r)
                del self.out[r]
        hit = [r for r in f.replicas if r not in self.out]
        for r in f.replicas:
            self.token[r] += 1  # a group already out loses its pending regroup: it waits for replacement
        for g in f.gpus:
            self.dead[self.topology.group_of(g)].add(g % self.topology.group_size)
        known = {r: self.believed(r) for r in hit}  # before the detector forgets the groups that leave
        super().interrupt(t, f)  # in-step recovery without the hit groups; they are out until replaced
        if f.scope == "software":
            return
        for r in hit:
            self.returns.pop(r, None)
            self.acted[r] = False  # the detector starts the group afresh: a Slow verdict is acted on anew
            back = self.out[r][0]
            d = self.decide(t, r, known[r], back, f"lost ranks {sorted(self.dead[r])}")
            if d.chosen.plan is not None:
                ready = t + self.costs.detect_seconds + d.chosen.replan_seconds
                self.engine.at(ready, "regroup", (r, d.chosen.plan, self.token[r]))

    def _on_regroup(self, t: float, payload: tuple[int, Plan, int]) -> None:
        """A shrunk group has re-formed on its survivors and pulled its shards: it rejoins the step."""
        r, plan, token = payload
        if token != self.token[r] or r not in self.out:
            return
        self.returns[r] = self.out.pop(r)[0]
        self.plans[r] = plan
        self._regroup(t, "replan")

    def _on_back(self, t: float, replica: int) -> None:
        if replica in self.returns:  # a shrunk group's replaced ranks are usable: grow back
            if self.returns[replica] > t:
                return
            del self.returns[replica]
            self._gpu_clock(t)
            self.dead_gpus = {g for g in self.dead_gpus if self.topology.group_of(g) != replica}
            self.dead.pop(replica, None)
            d = self.decide(t, replica, self.believed(replica), self.horizon, "ranks back")
            if d.chosen.plan is None:  # only possible around a Slow rank: not applied, as in `apply`
                self.log.emit("group_plan_skipped", t, step=self.step, replica=replica, decision="drop")
                return
            self.plans[replica] = d.chosen.plan
            self.sync_weights()
            self.replan(t, d.chosen.replan_seconds, "replan")
            return
        if replica in self.out and self.out[replica][0] <= t:
            self.dead.pop(replica, None)
            self.plans[replica] = self.full  # a dropped group comes back whole, by healing
            self.sync_weights()
        super()._on_back(t, replica)

    # ---- fail-slow -----------------------------------------------------------------------------------
    def slow_begin(self, t: float, f: Fault) -> None:
        for g in f.gpus:
            self.rank_slow[self.topology.group_of(g)][g % self.topology.group_size].append(f.factor)
        super().slow_begin(t, f)

    def _on_slow_end(self, t: float, f: Fault) -> None:
        for g in f.gpus:
            self.rank_slow[self.topology.group_of(g)][g % self.topology.group_size].remove(f.factor)
        super()._on_slow_end(t, f)
        cfg = self.detector.config
        for r in f.replicas:
            if r in self.slow_out and not self.true_speeds(r):
                # its probe sees recover_steps calm steps, then it heals from a peer like a rejoin
                back = t + cfg.recover_steps * self.t_full + self.costs.rejoin_seconds
                self.engine.at(back, "slow_back", (r, self.token[r]))

    def drop_slow(self, r: int) -> None:
        """Take a Slow group out of the step (the scheduler chose drop); it is probed off the step and
        comes back when its slow rank is healthy again (`_on_slow_back`)."""
        cause = max(self.slow[r])[1] if self.slow.get(r) else "slow"
        self.out[r] = (float("inf"), cause)
        self.slow_out.add(r)

    def _on_slow_back(self, t: float, payload: tuple[int, int]) -> None:
        r, token = payload
        if token != self.token[r] or r not in self.slow_out:
            return
        self.slow_out.discard(r)
        del self.out[r]
        self.acted[r] = False
        self.detector.forget(r)  # a fresh record: the probe's calm steps are not the detector's
        d = self.decide(t, r, {}, self.horizon, "healthy again")
        self.plans[r] = d.chosen.plan or self.plans[r]
        self._regroup(t, "rejoin")

    def _regroup(self, t: float, why: str) -> None:
        """A group came back into the run with a new plan: new quota weights, then the next step starts
        (idle) or the step in flight pays one re-form and is re-planned (`why` names it in the log)."""
        self.sync_weights()
        if self.seg is None:
            if t >= self.busy_until:
                self.start(t)
        else:
            self.replan(t, self.costs.reform_seconds, why)

    def believed(self, r: int) -> dict[int, float]:
        """What the runtime would know of group r's ranks: while its verdict is Slow, the detector's speed
        estimate pinned on its slowest live rank; otherwise every rank healthy."""
        truth = {k: v for k, v in self.true_speeds(r).items() if k not in self.dead[r]}
        if not self.acted.get(r) or not truth:
            return {}
        worst = min(truth, key=lambda k: (truth[k], k))
        return {worst: self.detector.speeds().get(r, 1.0)}

    def apply(self, t: float, weights: dict[int, float] | None) -> None:
        """After each observed step: a group newly Slow, or Healthy again after one, is re-planned (the
        detector's quota weights are not used: each plan's weight is)."""
        verdicts = self.detector.verdicts()
        changed, stall = False, 0.0
        for r in self.members:
            slow = verdicts.get(r) is Verdict.SLOW
            if slow == self.acted.get(r, False) or (slow and not self.true_speeds(r)):
                continue  # no change, or a false alarm: no rank to pin it on, nothing is moved
            self.acted[r] = slow
            # a slow episode's end is unknown when it starts: its re-plan cost is spread over the run
            d = self.decide(t, r, self.believed(r), self.horizon, "slow" if slow else "healthy again")
            if d.chosen.plan is None and slow:
                self.drop_slow(r)
                changed, stall = True, max(stall, d.chosen.replan_seconds)
                continue
            if d.chosen.plan is None:  # healthy again yet dropping predicted better: not applied
                self.log.emit("group_plan_skipped", t, step=self.step, replica=r, decision="drop")
                continue
            stall = max(stall, d.chosen.replan_seconds)
            changed |= d.chosen.plan != self.plans[r]
            self.plans[r] = d.chosen.plan
        if changed:
            self.sync_weights()
            self.log.emit("quotas", t, step=self.step, weights={str(r): round(s, 4) for r, s in
                                                                (self.weights or {}).items() if s != 1.0})
            self.replan(t, stall, "replan")
