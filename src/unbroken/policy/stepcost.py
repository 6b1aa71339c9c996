"""The cost model of a step under replica-group plans, and of changing a group's plan.

Owns: the stated constants (`Hardware`, `ModelShape`), the step's work (`Work`, calibrated from the
predictor's per-microbatch time), a stage's time per microbatch, a group's pipelined time for its quota,
the whole step's time under everyone's plans (quotas from `workload`), and the state a plan change moves.
Does not own: choosing a plan (policy/replan_scheduler.py), the plan's shape (policy/replan_plans.py), or measuring anything.

The model, per microbatch of `tokens` tokens, on stage k of a plan with TP degree t and FSDP2 degree f:
  compute    n_k / L * device_seconds / (t f) / speed_k     (the team's slowest rank decides: it holds
             the others at every collective; speed 1.0 healthy, 0.25 = 4x slower)
  TP comm    n_k * 4 all-reduces (2 forward, 2 backward, Megatron-style) of tokens * activation bytes,
             ring cost 2 (t-1)/t * bytes / tp_bytes_per_s
  FSDP comm  per layer 2 all-gathers (forward, and again in backward: FSDP2 frees a layer's gathered
             weights after its forward) of its weights over the team's f shards, ring cost
             (f-1)/f * weight bytes / t / tp_bytes_per_s (a group's FSDP2 ranks share a host); FSDP2
             gathers the next layer while computing this one, so a layer takes the larger of its compute
             and its gathers, not their sum; the gradients' reduce-scatter, once a batch, is left out
  PP comm    pp > 1: 2 boundary transfers (activation forward, its gradient backward) of
             tokens * activation bytes at pp_bytes_per_s
A group's m microbatches through a pp-stage pipeline (GPipe / 1F1B) take (m + pp - 1) x the slowest
stage's time: the bubble is (pp-1)/(m+pp-1) of it. The step is the slowest group plus `sync_seconds`.
Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from unbroken.policy import workload
from unbroken.policy.replan_plans import Plan


@dataclass(frozen=True)
class Hardware:
    """Link speeds, memory and re-form time. Defaults are for H100 hosts; all are chosen, not measured
    (a run's come from its config [hardware], whose defaults are these)."""
    tp_bytes_per_s: float = 150e9  # per-GPU bus bandwidth of a TP all-reduce in a host (NVLink 4's 450 GB/s
    # per direction, a third of it achieved by small all-reduces)
    pp_bytes_per_s: float = 25e9  # one GPU's share of the inter-host fabric (a 200 Gb/s NIC per GPU)
    peer_bytes_per_s: float = 25e9  # a rank pulling state from a peer group's rank, over the same NIC
    state_budget_bytes: float = 60e9  # per GPU for parameters, gradients and optimizer state (80 GB HBM
    # less room for activations)
    reform_seconds: float = 2.0  # re-form the group's and the cross-group process groups after a change


@dataclass(frozen=True)
class ModelShape:
    layers: int  # transformer blocks (embedding and head counted into the first and last, not modelled)
    state_bytes_per_layer: float  # parameters + gradients + optimizer state of one block, bytes (16 B a
    # parameter with bf16 weights and fp32 master + Adam moments)
    activation_bytes_per_token: float  # one block boundary's activation, bytes per token (hidden x 2 in bf16)
    weight_bytes_per_layer: float = 0.0  # one block's weights as FSDP2 gathers them, bytes (2 B a parameter
    # in bf16); 0: FSDP2's all-gathers are not priced


@dataclass(frozen=True)
class Work:
    device_seconds: float  # one microbatch forward+backward through every layer on one GPU, no comm, s
    tokens: int  # tokens per microbatch
    microbatches: int  # M: microbatches of every step (never changes)
    sync_seconds: float = 0.0  # cross-group reduction + optimizer step after the last microbatch, s


@dataclass(frozen=True)
class Setting:
    """Everything the cost model needs besides the plans: one value the scheduler passes around."""
    model: ModelShape
    hardware: Hardware
    work: Work


def tp_comm(tp: int, s: Setting) -> float:
    """TP all-reduce seconds per layer per microbatch."""
    if tp == 1:
        return 0.0
    volume = s.work.tokens * s.model.activation_bytes_per_token
    return 4 * 2 * (tp - 1) / tp * volume / s.hardware.tp_bytes_per_s


def pp_comm(pp: int, s: Setting) -> float:
    """Stage-boundary seconds per microbatch (send activation, receive its gradient)."""
    return 0.0 if pp == 1 else 2 * s.work.tokens * s.model.activation_bytes_per_token / s.hardware.pp_bytes_per_s


def fsdp_comm(tp: int, shard: int, s: Setting) -> float:
    """FSDP2 all-gather seconds per layer per microbatch over `shard` shards of a TP team of `tp`."""
    if shard == 1:
        return 0.0
    return 2 * (shard - 1) / shard * s.model.weight_bytes_per_layer / tp / s.hardware.tp_bytes_per_s


def per_layer_seconds(tp: int, speed: float, s: Setting, shard: int = 1) -> float:
    """One layer of one microbatch on a team of `shard` FSDP2 shards of a TP team of `tp`, whose slowest
    rank runs at `speed`, s."""
    compute = s.work.device_seconds / s.model.layers / tp / shard / speed
    return max(compute, fsdp_comm(tp, shard, s)) + tp_comm(tp, s)  # the gathers overlap the compute


def stage_seconds(plan: Plan, speeds: Mapping[int, float], s: Setting) -> tuple[float, ...]:
    """Each stage's time per microbatch, s (`speeds`: rank -> speed, missing = 1.0)."""
    fixed = pp_comm(plan.pp, s)
    return tuple(fixed + n * per_layer_seconds(plan.tp, min(speeds.get(r, 1.0) for r in team), s, plan.shard)
                 for n, team in zip(plan.stages, plan.teams))


def bottleneck(plan: Plan, speeds: Mapping[int, float], s: Setting) -> float:
    """The slowest stage's time per microbatch: the pipeline's steady-state time per microbatch, s."""
    return max(stage_seconds(plan, speeds, s))


def group_seconds(plan: Plan, microbatches: int, speeds: Mapping[int, float], s: Setting) -> float:
    """A group's compute time for `microbatches` through its pipeline, bubble included, s (0 for none)."""
    return (microbatches + plan.pp - 1) * bottleneck(plan, speeds, s) if microbatches else 0.0


def calibrate(per_microbatch_seconds: float, full: Plan, model: ModelShape, hardware: Hardware,
              tokens: int, microbatches: int, sync_seconds: float = 0.0) -> Setting:
    """The Setting whose full plan on healthy ranks takes `per_microbatch_seconds` per microbatch in
    steady state (what the predictor, `CostModel.predict(tokens, sumsq)`, says a healthy group's
    microbatch costs). Solves the model above for device_seconds. Raises ValueError when the stated
    communication alone already exceeds that time (the constants contradict the measurement)."""
    probe = Setting(model, hardware, Work(0.0, tokens, microbatches, sync_seconds))
    n = max(full.stages)
    comm = pp_comm(full.pp, probe) + n * tp_comm(full.tp, probe)
    if per_microbatch_seconds <= comm:
        raise ValueError(f"{per_microbatch_seconds} s per microbatch is below the plan's communication {comm:.4g} s")
    layer = (per_microbatch_seconds - comm) / n  # one layer's compute, or its FSDP2 gathers where they are longer
    if layer <= fsdp_comm(full.tp, full.shard, probe):
        raise ValueError(f"{per_microbatch_seconds} s per microbatch leaves a layer {layer:.4g} s, no more than "
                         f"its FSDP2 gathers: the compute cannot be told from the communication")
    device = layer * full.tp * full.shard * model.layers
    return Setting(model, hardware, Work(device, tokens, microbatches, sync_seconds))


def rate(plan: Plan, speeds: Mapping[int, float], full: Plan, s: Setting) -> float:
    """Microbatch throughput of `plan` relative to `full` on healthy ranks: the quota weight it earns."""
    return bottleneck(full, {}, s) / bottleneck(plan, speeds, s)


def step_seconds(plans: Mapping[int, Plan], speeds: Mapping[int, Mapping[int, float]], s: Setting
                 ) -> tuple[float, tuple[int, ...]]:
    """(seconds of the step, owners) with every group in `plans` taking quotas by its plan's weight.

    `owners` is `workload.assign(M, groups, weights)`: every microbatch (s, 0..M-1) has exactly one group,
    so the batch is constant whatever the plans. No group at all: (inf, ()).
    """
    if not plans:
        return float("inf"), ()
    owners = workload.assign(s.work.microbatches, sorted(plans), {g: p.weight for g, p in plans.items()})
    counts = {g: 0 for g in plans}
    for g in owners:
        counts[g] += 1
    # most groups share one plan object and no slow rank: price each distinct (plan, speeds) once, so a
    # step of 128 groups x 16 stages costs a few stage sums, not 128 of them
    memo: dict[tuple[int, tuple[tuple[int, float], ...]], float] = {}
    slowest = 0.0
    for g, p in plans.items():
        sp = speeds.get(g, {})
        key = (id(p), tuple(sorted(sp.items())))
        if key not in memo:
            memo[key] = bottleneck(p, sp, s)
        if counts[g]:
            slowest = max(slowest, (counts[g] + p.pp - 1) * memo[key])
    return slowest + s.work.sync_seconds, owners


def _units(full: Plan) -> int:
    """The parts a layer's state is counted in: 1/(tp x shard) of a layer, the full plan's smallest
    holding (every plan's tp divides full.tp, and a smaller plan never shards: policy/replan_plans.py)."""
    return full.tp * full.shard


def _holdings(plan: Plan | None, units: int) -> dict[int, tuple[range, range]]:
    """rank -> (layers it holds, its slice in 1/units of a layer: its TP slice, or its FSDP2 shard's rows
    of it), under `plan`."""
    if plan is None:
        return {}
    out = {}
    for layers, team in zip(plan.layer_ranges(), plan.teams):
        width = units // (plan.tp * plan.shard)
        for j, r in enumerate(team):
            out[r] = (layers, range(j * width, (j + 1) * width))
    return out


def _overlap(a: range, b: range) -> int:
    return max(0, min(a.stop, b.stop) - max(a.start, b.start))


def moved_bytes(old: Plan | None, new: Plan | None, alive: Collection[int], full: Plan, s: Setting
                ) -> dict[int, float]:
    """rank -> bytes of state it must receive to serve `new`, having served `old` (None: nothing held).

    A rank holds its stage's layers and its TP slice of each; ranks not `alive` hold nothing (dead, or
    just returned). What it lacks it pulls from the matching ranks of a live peer group, which hold the
    full plan's shards, or from a surviving rank of its own group. Slices are counted in `_units`.
    """
    units = _units(full)
    per_unit = s.model.state_bytes_per_layer / units
    had, need = _holdings(old, units), _holdings(new, units)
    out = {}
    for r, (layers, tslice) in need.items():
        lacking = len(layers) * len(tslice)
        if r in had and r in alive:
            hl, ht = had[r]
            lacking -= _overlap(layers, hl) * _overlap(tslice, ht)
        if lacking:
            out[r] = lacking * per_unit
    return out


def self_sufficient(old: Plan | None, alive: Collection[int], full: Plan) -> bool:
    """True when the group's surviving ranks together still hold every layer's whole state under `old`
    (so a re-plan needs no peer group)."""
    units = _units(full)
    held: dict[int, set[int]] = {}
    for r, (layers, tslice) in _holdings(old, units).items():
        if r in alive:
            for layer in layers:
                held.setdefault(layer, set()).update(tslice)
    return all(len(held.get(layer, ())) == units for layer in range(full.layers))
