"""The simulated cluster's layout and its failures, drawn once per seed.

Owns: which replica groups a GPU or a node belongs to (layout DP x TP x PP, replica groups laid out
contiguously over nodes), and the fault trace: every fail-stop, software failure and fail-slow episode of a
run, with its time, cause and the replica groups it hits. Does not own: reacting to faults (strategies/).

Random causes are Poisson processes; their superposition is drawn as one stream (total rate, then the
cause by its share), so the cost is per failure, never per GPU. Every strategy replays the same trace for
a seed (common random numbers), so differences between strategies are not sampling noise.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from unbroken.sim.scenario import Scenario
from unbroken.topology import Topology


@dataclass(frozen=True)
class Fault:
    t: float  # virtual clock, s
    cause: str
    scope: str  # gpu | node | software | slow
    gpus: tuple[int, ...]  # GPUs hit (empty for software failures)
    replicas: tuple[int, ...]  # replica groups hit, sorted
    factor: float = 1.0  # slow: how many times slower
    duration: float = 0.0  # slow: episode length, s


class Layout:
    """GPU g is global rank g of the topology: in replica group g // replica_gpus, on node g // gpus_per_node
    (topology.py, the runtime's arithmetic)."""

    def __init__(self, scenario: Scenario):
        c = scenario.cluster
        self.topology = Topology(c.dp, c.replica_gpus, c.gpus_per_node)
        self.gpus, self.replica_gpus, self.gpus_per_node = c.gpus, c.replica_gpus, c.gpus_per_node
        self.nodes = self.topology.nodes

    def replica_of(self, gpu: int) -> int:
        return self.topology.group_of(gpu)

    def node_gpus(self, node: int) -> range:
        return self.topology.node_ranks(node)

    def replicas_of(self, gpus: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({self.replica_of(g) for g in gpus}))


def draw_faults(scenario: Scenario, seed: int) -> tuple[Fault, ...]:
    """All faults of the run, sorted by time; the same seed gives the same tuple.

    Random causes are drawn with `random.Random(seed)` over [0, duration); trace events are added at their
    stated times, and hit the lowest-numbered GPUs or nodes not yet taken by an earlier trace event, so a
    trace that says "lose 4 nodes" loses 4 distinct nodes.
    """
    layout = Layout(scenario)
    horizon = scenario.workload.duration_hours * 3600.0
    rng = random.Random(seed)
    faults = [_traced(scenario, layout, horizon)]
    rates = [(c, c.rate_per_second(layout.gpus)) for c in scenario.causes]
    total = sum(r for _, r in rates)
    drawn: list[Fault] = []
    t = 0.0
    while total > 0:
        t += rng.expovariate(total)
        if t >= horizon:
            break
        pick = rng.random() * total
        for cause, rate in rates:
            pick -= rate
            if pick < 0:
                break
        drawn.append(_make(cause.name, cause.scope, cause.units, t, rng.randrange(layout.gpus), layout,
                           cause.factor, cause.duration_seconds))
    return tuple(sorted(faults[0] + drawn, key=lambda f: f.t))


def _traced(scenario: Scenario, layout: Layout, horizon: float) -> list[Fault]:
    out = []
    next_gpu = next_node = 0
    for e in scenario.trace:
        if e.scope == "node":
            first = next_node * layout.gpus_per_node
            next_node += e.units
            next_gpu = max(next_gpu, next_node * layout.gpus_per_node)
        else:
            first = next_gpu
            next_gpu += e.units if e.scope != "software" else 0
            next_node = -(-next_gpu // layout.gpus_per_node)
        out.append(_make(e.cause, e.scope, e.units, e.at_hours * 3600.0, first % layout.gpus, layout,
                         e.factor, e.duration_seconds))
    return out


def _make(cause: str, scope: str, units: int, t: float, gpu: int, layout: Layout, factor: float,
          duration: float) -> Fault:
    if scope == "software":
        return Fault(t, cause, scope, (), ())
    if scope == "node":
        node = gpu // layout.gpus_per_node
        gpus = tuple(g for n in range(node, node + units) for g in layout.node_gpus(n % layout.nodes))
    else:
        gpus = tuple((gpu + i) % layout.gpus for i in range(units))
    return Fault(t, cause, scope, gpus, layout.replicas_of(gpus), factor, duration)
