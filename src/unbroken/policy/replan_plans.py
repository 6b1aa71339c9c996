"""A replica group's parallel plan: TP and FSDP degrees, pipeline stages, their layers and ranks, quota weight.

Owns: the frozen `Plan` value (checked when built: every layer in exactly one stage, in order; every
stage's team of `tp` x `shard` distinct ranks), the group's full plan from its topology (`full_plan`), the
teams a set of surviving ranks can form (`teams`), and the layer partition that balances stages of
unequal speed (`partition`). Does not own: what a plan costs (stepcost.py) or which plan to take
(policy/replan_scheduler.py). Pure: plain ints and floats, the standard library only.

Rank layout is the topology's (TP innermost): the full plan's stage k is ranks k*t .. k*t + t-1 with
t = tp x shard (FSDP2 shards of TP teams), one host's GPUs for the usual TP 8 on 8-GPU hosts. A smaller
plan keeps every TP team inside one of the full plan's teams (the fast intra-host links), so shrinking
never stretches tensor parallelism across hosts. A smaller plan never shards with FSDP2: another FSDP2
degree cuts every parameter's rows elsewhere, where the cross-group reduction of shard index j needs
the same rows in every group (a group that lost an FSDP2 rank goes on as one rank holding every shard).
"""
from __future__ import annotations

import heapq
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from unbroken.topology import Topology


@dataclass(frozen=True)
class Plan:
    """How one replica group computes: `stages[k]` layers on stage k, computed by the team `teams[k]`:
    `shard` FSDP2 shards (each its share of every microbatch's rows) of a TP team of `tp` ranks."""
    tp: int  # tensor-parallel degree of every stage
    stages: tuple[int, ...]  # layers per pipeline stage, in pipeline order (contiguous runs of layers)
    teams: tuple[tuple[int, ...], ...]  # group ranks of each stage's team; teams[k][f * tp + j] has FSDP
    # shard index f and TP index j (TP innermost, as the topology lays ranks out)
    weight: float = 1.0  # quota weight: microbatch throughput relative to the full plan on healthy ranks
    shard: int = 1  # FSDP2 degree inside every stage (1: none)

    def __post_init__(self) -> None:
        ranks = [r for team in self.teams for r in team]
        if self.tp < 1 or self.shard < 1 or not self.stages or len(self.stages) != len(self.teams):
            raise ValueError(f"plan needs tp >= 1 and one team per stage: {self}")
        if min(self.stages) < 1 or any(len(team) != self.tp * self.shard for team in self.teams):
            raise ValueError(f"every stage needs >= 1 layer and a team of tp x shard = {self.tp} x {self.shard} "
                             f"ranks: {self}")
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"a rank may serve one stage only: {self}")
        if not self.weight > 0:
            raise ValueError(f"quota weight must be > 0: {self}")

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def layers(self) -> int:
        return sum(self.stages)

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for team in self.teams for r in team)

    def layer_ranges(self) -> tuple[range, ...]:
        """The layers of each stage: contiguous, in order, covering 0 .. layers-1 once."""
        out, first = [], 0
        for n in self.stages:
            out.append(range(first, first + n))
            first += n
        return tuple(out)

    def shape(self) -> str:
        """A short human label, e.g. 'tp8 pp3 [27,27,26]' ('tp1 pp1 [4] fsdp2' with FSDP2 inside)."""
        fsdp = f" fsdp{self.shard}" if self.shard > 1 else ""
        return f"tp{self.tp} pp{self.pp} [{','.join(map(str, self.stages))}]{fsdp}"


def full_plan(topology: Topology, layers: int) -> Plan:
    """The plan a group starts with: the topology's tp x dp_shard x pp, layers split evenly (earlier
    stages take the remainder). Raises ValueError when there are fewer layers than stages."""
    tp, pp, shard = topology.tp, topology.pp, topology.dp_shard
    if layers < pp:
        raise ValueError(f"{layers} layers cannot fill {pp} stages")
    stages = tuple(layers // pp + (k < layers % pp) for k in range(pp))
    team = tp * shard
    return Plan(tp, stages, tuple(tuple(range(k * team, (k + 1) * team)) for k in range(pp)), shard=shard)


def teams(full: Plan, alive: Collection[int], tp: int, speeds: Mapping[int, float]) -> list[tuple[int, ...]]:
    """Every TP team of `tp` ranks (no FSDP2: a smaller plan never shards) the survivors can form, each
    inside one team of the full plan, in the full plan's stage order. Within a host the fastest survivors
    are taken first (then the lowest rank), so a slow or dead GPU is what is left out. `tp` must divide
    full.tp (heads split evenly)."""
    if tp < 1 or full.tp % tp:
        raise ValueError(f"tp={tp} must divide the full plan's tp={full.tp}")
    out = []
    for host in full.teams:
        live = sorted((r for r in host if r in alive), key=lambda r: (-speeds.get(r, 1.0), r))
        for i in range(len(live) // tp):
            out.append(tuple(sorted(live[i * tp:(i + 1) * tp])))
    return out


def partition(layers: int, per_layer: Sequence[float], fixed: Sequence[float],
              capacity: Sequence[int]) -> tuple[int, ...] | None:
    """Layers per stage minimising the slowest stage's time `fixed[k] + n_k * per_layer[k]` (s), with
    1 <= n_k <= capacity[k] (layers whose state fits stage k's memory). None when they cannot all fit.

    Greedy water-filling: each layer goes to the stage whose time after taking it is least (ties: the
    earlier stage). Layers cost the same, so this is optimal for the bottleneck; O(layers log stages).
    """
    pp = len(per_layer)
    if pp == 0 or layers < pp or min(capacity) < 1 or sum(capacity) < layers:
        return None
    counts = [1] * pp
    heap = [(fixed[k] + 2 * per_layer[k], k) for k in range(pp) if capacity[k] > 1]
    heapq.heapify(heap)
    for _ in range(layers - pp):
        _, k = heapq.heappop(heap)
        counts[k] += 1
        if counts[k] < capacity[k]:
            heapq.heappush(heap, (fixed[k] + (counts[k] + 1) * per_layer[k], k))
    return tuple(counts)


def coarsen(full: Sequence[int], stages: int, per_layer: Sequence[float], fixed: Sequence[float],
            capacity: Sequence[int]) -> tuple[int, ...] | None:
    """Layers per stage of `stages` stages, each the union of consecutive stages of the `full` split (its
    layers per stage), minimising the slowest stage's time as `partition` does; None when none fits.

    Why: shard index j of every group reduces the same layers across groups, so a group whose surviving
    ranks re-form into fewer stages can hold whole old stages only (each rank then holds the shard
    indices of the old stages it merged). Dynamic programming over (old stages taken, new stages
    filled): O(len(full)^2 x stages)."""
    n = len(full)
    if not 1 <= stages <= n or len(per_layer) != stages:
        return None
    starts = [0]
    for layers in full:
        starts.append(starts[-1] + layers)
    inf = float("inf")
    # best[k][i]: the least bottleneck of new stages 0..k-1 over old stages 0..i-1; cut[k][i] its last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                layers = starts[i] - starts[j]
                if best[k - 1][j] == inf or layers > capacity[k - 1]:
                    continue
                t = max(best[k - 1][j], fixed[k - 1] + layers * per_layer[k - 1])
                if t < best[k][i]:
                    best[k][i], cut[k][i] = t, j
    if best[stages][n] == inf:
        return None
    out, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        out.append(starts[i] - starts[j])
        i = j
    return tuple(reversed(out))


def aligned(plan: Plan, full: Plan) -> bool:
    """Whether every stage of `plan` is a union of consecutive stages of `full` (see `coarsen`)."""
    ends = {r.stop for r in full.layer_ranges()}
    return plan.layers == full.layers and all(r.stop in ends for r in plan.layer_ranges())


def plans_json(plans: Mapping[int, Plan]) -> str:
    """`plans` as the store keeps them (`keys.shrunk`)."""
    return json.dumps({str(g): {"tp": p.tp, "stages": list(p.stages), "teams": [list(t) for t in p.teams],
                                "weight": p.weight, "shard": p.shard} for g, p in sorted(plans.items())})


def plans_from(raw: bytes | str | None) -> dict[int, Plan]:
    """What `plans_json` wrote ({} for nothing)."""
    return {int(g): Plan(d["tp"], tuple(d["stages"]), tuple(tuple(t) for t in d["teams"]), d["weight"],
                         d.get("shard", 1)) for g, d in json.loads(raw or b"{}").items()}
