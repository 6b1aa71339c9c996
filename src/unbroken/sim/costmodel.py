"""A GPU cost model for what the runtime does: the recovery costs a scenario charges, derived instead of chosen.

Owns: each cost the strategies charge (kill to the next commit, a rejoin's heal, a re-form, a snapshot's
blocking part, a restore from memory, a checkpoint's blocking part, a reload from storage) and the per-step
cross-group gradient reduction, NCCL over the network and gloo through host memory priced separately, as
a formula over the scenario's model and layout, with every input named: a cost the runtime measured on
this machine where it transfers (a count of round trips, steps to recover, a ratio to the link), or a
stated bandwidth with its source where it does not. Does not own: running anything (calibrate.py prints
the table; strategies read a scenario's `costs`), or the measurements (benchmarks/RESULTS.md).

What transfers and what does not: the runtime's protocol is the same on GPUs (the same messages, the
same steps to recover), so step counts and ratios carry over; its seconds on this 2-core host do not
(gloo on CPU, loopback links, imports on shared cores), so bytes are priced at the GPU cluster's links.
"""
from __future__ import annotations

from dataclasses import dataclass

from unbroken.sim.scenario import Scenario

GB = 1e9


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str


# Stated bandwidths (per GPU, one direction) and the runtime's measured figures, each with its source.
FIGURES: dict[str, Figure] = {
    "nvlink": Figure(450.0, "GB/s", "NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s per GPU both directions"),
    "ib": Figure(50.0, "GB/s", "NVIDIA ConnectX-7 / InfiniBand NDR: 400 Gb/s per port, one NIC per GPU"),
    "pcie": Figure(63.0, "GB/s", "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b (H100 SXM's host link)"),
    "host_memcpy": Figure(23.4, "GB/s", "measured here: benchmarks/erasure.py memcpy of 1.2 GB (RESULTS.md)"),
    "gloo_host": Figure(0.75, "GB/s", "measured here: a plain gloo send/recv between two processes, 152 MB "
                        "(rejoin.py, RESULTS.md): gloo's TCP path, the cross-group reduction's CPU transport"),
    "storage": Figure(2000.0, "GB/s", "Llama 3 paper sec. 3.3.1: Tectonic, 2 TB/s sustained (7 TB/s peak): "
                      "check against the paper before quoting"),
    "heal_over_link": Figure(1.112, "x", "measured here: rejoin.py median heal_over_link (the heal's 16 MB "
                             "buckets against one plain send/recv of the same bytes): the heal runs at link speed"),
    "restart_fixed": Figure(11.8, "s", "measured here: rejoin.py kill -> back, torchrun restart 0.65 + imports "
                            "and set-up 6.30 + admission 4.84 (RESULTS.md, last run), before the heal"),
    "kill_steps": Figure(1.43, "steps", "measured here: recovery.py, a SIGKILL to the next committed step, "
                         "median in failure-free step times (4 replicas, 8 microbatches)"),
    "kill_seen": Figure(0.058, "s", "measured here: recovery.py, kill -> member_dead (broken process group)"),
    "save_async": Figure(0.00135, "s", "measured here: snapshot_bandwidth.py, save_async of 1.2 GB returns "
                         "in 1.35 ms (the copy proceeds behind)"),
    "rendezvous": Figure(0.047, "s", "measured here: rejoin.py, a two-rank gloo rendezvous (RESULTS.md)"),
}


@dataclass(frozen=True)
class Cost:
    name: str  # the scenario's `costs` key it prices, or a per-step figure
    seconds: float
    formula: str  # how it is computed, with the inputs' values
    inputs: tuple[str, ...]  # FIGURES keys used


def derive(sc: Scenario) -> list[Cost]:
    """The costs of `sc` from its model and layout; pure arithmetic, any time."""
    m, c, w = sc.model, sc.cluster, sc.workload
    f = {k: v.value for k, v in FIGURES.items()}
    state = m.layers * m.state_gb_per_layer * GB  # the whole model's training state, B
    per_gpu = state / c.replica_gpus  # one rank's share inside its group, B
    share = per_gpu / c.dp  # its snapshot share, sharded across the replicas (REFT), B
    grads = per_gpu * 2 / 16  # bf16 gradients of its parameters (16 B of state per parameter), B
    ring = 2 * (c.dp - 1) / c.dp  # a ring all-reduce moves this x the bytes per rank
    step = max(1, -(-w.microbatches // c.dp)) * w.microbatch_seconds + w.sync_seconds
    heal = per_gpu / (f["ib"] * GB * min(1.0, f["heal_over_link"]))
    return [
        Cost("detect_seconds", f["kill_seen"], f"kill seen from the broken group: {f['kill_seen']} s "
             "(a hang waits for the heartbeat timeout instead)", ("kill_seen",)),
        Cost("kill_to_commit", f["kill_steps"] * step, f"{f['kill_steps']} failure-free steps x {step:.3g} s",
             ("kill_steps",)),
        Cost("reform_seconds", f["rendezvous"] * (c.dp.bit_length()), f"a rendezvous ({f['rendezvous']} s) per "
             f"doubling of {c.dp} groups (tree rendezvous; chosen form, measured unit)", ("rendezvous",)),
        Cost("rejoin_seconds", f["restart_fixed"] + heal, f"restart + set-up {f['restart_fixed']} s + heal "
             f"{per_gpu / GB:.3g} GB a rank over IB {f['ib']} GB/s ({heal:.3g} s)",
             ("restart_fixed", "ib", "heal_over_link")),
        Cost("snapshot_seconds", f["save_async"] + share / (f["pcie"] * GB),
             f"save_async {f['save_async']} s + its share {share / GB:.3g} GB over PCIe {f['pcie']} GB/s "
             "(device to host before the next optimizer step)", ("save_async", "pcie")),
        Cost("memory_restore_seconds", per_gpu / (f["ib"] * GB) + per_gpu / (f["pcie"] * GB),
             f"{per_gpu / GB:.3g} GB a rank gathered from peers' agents over IB and copied host to device",
             ("ib", "pcie")),
        Cost("checkpoint_seconds", per_gpu / (f["pcie"] * GB),
             f"{per_gpu / GB:.3g} GB a rank device to host; the write to storage overlaps training", ("pcie",)),
        Cost("reload_seconds", state / (f["storage"] * GB) + per_gpu / (f["ib"] * GB),
             f"{state / 1e12:.3g} TB read once at {f['storage']} GB/s, then a rank's {per_gpu / GB:.3g} GB "
             "broadcast to its replicas over IB", ("storage", "ib")),
        Cost("reduce_nccl_per_step", ring * grads / (f["ib"] * GB),
             f"ring all-reduce of {grads / GB:.3g} GB bf16 gradients a rank over {c.dp} groups, IB {f['ib']} GB/s",
             ("ib",)),
        Cost("reduce_gloo_host_per_step", 2 * grads / (f["pcie"] * GB) + ring * grads / (f["gloo_host"] * GB),
             f"the same through host memory: to host and back over PCIe, the ring at gloo's "
             f"{f['gloo_host']} GB/s", ("pcie", "gloo_host")),
    ]


def table(sc: Scenario) -> str:
    """The derived costs beside the scenario's chosen ones, then every input with its source."""
    have = vars(sc.costs)
    lines = [f"{sc.name}: {sc.cluster.gpus:,} GPUs (DP {sc.cluster.dp} x TP {sc.cluster.tp} x PP {sc.cluster.pp})",
             f"{'cost':28s} {'derived s':>11s} {'scenario s':>11s}  formula"]
    for cost in derive(sc):
        chosen = have.get(cost.name)
        lines.append(f"{cost.name:28s} {cost.seconds:11.4g} {'' if chosen is None else f'{chosen:.4g}':>11s}  "
                     f"{cost.formula}")
    lines.append("sources:")
    lines += [f"  {k:15s} {v.value:g} {v.unit}: {v.source}" for k, v in FIGURES.items()]
    return "\n".join(lines)
