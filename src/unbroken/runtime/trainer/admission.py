"""Admission: what a trainer does between connecting and training, as one group of ranks.

Owns: building the model, data and optimizer as this rank holds it (`build`, `build_standin`), the
group's one view of whether it joins a running job (`agree`), the run's signature a joiner must match
(`signature`), and joining: the admission request, the wait for it and the heal from a live group
(`join`). Does not own: when these run, or what an error means (lifecycle.py); the donor's side of a
heal (donor.py); the transfer itself (persist/healing.py).
"""
from __future__ import annotations

import hashlib
import os

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.model.optim import mark_no_decay
from unbroken.policy.membership import donor
from unbroken.runtime.parallel.accumulator import unique_parameters
from unbroken.runtime.parallel.parallelize import describe, parallelize
from unbroken.runtime.parallel.precision import prepare
from unbroken.runtime.parallel.standin import StandIn
from unbroken.runtime.persist.healing import Forming, receive
from unbroken.runtime.persist.state import materialize
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.heartbeat import Beats, Heartbeat
from unbroken.runtime.trainer.membership import Coordination
from unbroken.runtime.trainer.placement import Factories
from unbroken.runtime.trainer.stepwork import Parts
from unbroken.topology import Identity


def build(cfg: Config, factories: Factories, who: Identity, group, device=None) -> Parts:
    """The model (as this rank holds it, on `device`: CPU when None), data and optimizer over the replica
    group's own process group (`intra_group`; None for one-rank groups). The thread count is the same on
    every replica, so kernels sum in the same order; the seed makes the initial parameters identical."""
    import torch

    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    device = torch.device("cpu") if device is None else device
    topology = cfg.topology()
    # moved before parallelize: TP and the pipeline stage move only what they split, FSDP2 all of it
    model = factories.build_model(cfg).to(device)
    data = factories.data(cfg)  # after the model: its initial parameters take the seed's first draws
    shape = stage_shape(data, topology.dp_shard) if topology.pp > 1 else None
    plan = factories.plan_of(model)
    model, stages = parallelize(model, topology, group, cfg.run.exact, who.rank, shape, device,
                                cfg.parallel.mixed_precision, cfg.model.activation_checkpointing,
                                plan, factories.parallelize, compile_backend=compiled(cfg))
    return Parts(model, data, optimizer_for(factories, model, cfg), group, stages, inputs=plan.inputs,
                 applied=describe(model, plan, stages) if group is not None or cfg.model.compile else {})


def compiled(cfg: Config) -> str | None:
    """The torch.compile backend each block is compiled with (model.compile), or None: eager."""
    return cfg.model.compile_backend if cfg.model.compile else None


def stage_shape(data, shards: int) -> tuple[int, int]:
    """(rows, tokens) of one pipeline stage's microbatch: one FSDP2 shard's rows (data.part) of the data's
    own microbatches, read off its first (every microbatch of a run has one shape, the data contract; a
    user's data need not match the data.* keys). Call once per build of a stage."""
    rows, seq = data.microbatch(0, 0).x.shape
    return rows // shards, int(seq)


def optimizer_for(factories: Factories, model, cfg: Config):
    """The factory's optimizer over the model's parameters as this rank holds them, after marking those the
    default parameter groups keep out of weight decay (model/optim.mark_no_decay; a user's factory may
    read the marks or not)."""
    mark_no_decay(model, cfg.optim)
    return factories.optimizer(unique_parameters(model), cfg)


def build_standin(cfg: Config, factories: Factories, device=None) -> Parts:
    """A shrunk group's one rank: the whole model (its state comes from a peer group's ranks by healing, so
    the seed matters only for determinism), every stage's, TP rank's or FSDP2 shard's shard index held
    (standin.py)."""
    import torch

    torch.manual_seed(cfg.run.seed)
    device = torch.device("cpu") if device is None else device
    model = factories.build_model(cfg).to(device)
    plan = factories.plan_of(model)
    model = prepare(model, cfg.parallel.mixed_precision, cfg.model.activation_checkpointing, device,
                    plan, compiled(cfg))  # unsharded: autocast, not FSDP2's policy
    standin = StandIn(model, cfg.parallel.pp, cfg.parallel.tp, cfg.topology().dp_shard, plan=plan)
    return Parts(model, factories.data(cfg), optimizer_for(factories, model, cfg), None, None, standin,
                 plan.inputs)


def agree(group, joining: bool, restart: int, me: int) -> tuple[bool, str]:
    """(Whether this group's ranks join a running job, the nonce of their one admission request), the same
    on every rank: rank 0's nonce, and joining if any rank would. Call once per process, after
    `intra_group` and before the heartbeat starts. Neither torchrun's restart count nor a rank's own view
    of the coordinator is common to a group's ranks: a rank its own agent restarted is attempt r + 1, its
    peers, restarted by their agents for the membership change, attempt r, and a peer may look before
    the coordinator has declared the group dead. Raises what a collective of a broken group raises."""
    import secrets

    import torch.distributed as dist

    nonce = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'direct')}-{restart}-{me}-{secrets.token_hex(4)}"
    if group is None:
        return joining, nonce
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (joining, nonce), group=group)
    return any(j for j, _ in views), views[0][1]


def signature(cfg: Config, parts: Parts) -> str:
    """sha256 of the run's config and the model's parameter names, global shapes and dtypes: what every
    group must share (a joiner built from other code or another config is refused before loading)."""
    h = hashlib.sha256(cfg.to_json().encode())
    for name, p in parts.model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()


def join(cfg: Config, who: Identity, coord: Coordination, heartbeat: Heartbeat | Beats, parts: Parts, log: EventLog,
         restart: int, nonce: str, admitted: int | None = None) -> tuple[int, object]:
    """Rejoin a running job: ask for admission (rank 0), wait for it, beat again, then take the state after
    step s from rank j of the donor group that policy.membership chose. Returns (s + 1, the plan of s + 1).
    `admitted`: the epoch that admitted this rank's shrunk group, whose survivors asked before they built
    (replan_reform.agree); it takes each shard index it holds from the donor's ranks, one heal each. Call once, after `build`, before
    training. The admission waits for the old incarnation to be declared dead (a heartbeat timeout, or
    at once after a `leave`) and for a step boundary: up to the start-up timeout."""
    # The optimizer's state tensors to load into, before asking: its one step imports torch._dynamo
    # (~1 CPU-s, AdamW's first step), which done after the request landed in the survivors' steps around
    # the admission on a shared host, the window the rejoin's stall is measured over (benchmarks/rejoin.py).
    materialize(parts.model, parts.optimizer)
    wait, timeout = cfg.coord.startup_timeout, cfg.coord.collective_timeout
    if admitted is None:  # a shrunk group's survivors asked and were admitted before they built (replan_reform.agree)
        if who.rank == 0:
            coord.ask_to_join(nonce, restart)
        admitted = coord.admitted(nonce, wait)
    coord.incarnation = str(admitted)  # its survivors claim a stand-in for this incarnation (claim_standin)
    heartbeat.start()
    standin = parts.standin
    shards = [(j, lambda j=j: standin.heal_tensors(j, parts.optimizer)) for j in standin.held] \
        if standin else [(who.rank, None)]

    def forming(d: int, shard: int) -> Forming:
        return Forming(coord.group_store(), keys.heal_prefix(who.group, admitted, d, shard), 1, timeout)

    # the donor of the step boundary ahead, as the members will pick it if nobody dies meanwhile
    likely = donor([m for m in coord.members(admitted) if m != who.group], who.group)
    early = [forming(likely, j) for j, _ in shards]
    step, chosen, plan = coord.heal_offer(admitted, wait)
    heartbeat.at(step, "heal")
    received = 0
    for (j, shard), ready in zip(shards, early):
        got, seconds, transfer = receive(ready if chosen == likely else forming(chosen, j), parts.model,
                                         parts.optimizer, shard)
        received += got
        log.emit("heal", replica=who.group, donor=chosen, step=step, bytes=got, seconds=round(seconds, 6),
                 transfer=round(transfer, 6), side="joiner",
                 **({"rank": j} if who.group_size > 1 else {}), **({"shrunk": True} if standin else {}))
    coord.report_healed(admitted, who.rank, received)
    return step + 1, plan
