"""A replica group that lost ranks, re-formed from its survivors (parallel.on_rank_loss=replan): the plan
the coordinator's scheduler chose for them, the new process group among its ranks, and what each builds.

Owns: the survivors' agreement (`agree`: the first survivor to claim asks the coordinator to go on with
every survivor that claimed; each then waits for the admission, reads the plan chosen, and takes its
stage in it or leaves), the process group of the plan's ranks (`regroup`), and the model each rank of a
plan of several ranks builds (`build`). Does not own: the choice (policy/replan_scheduler.py, asked by
coordinator/replan.py, which executes only plans this module can build: `replan.reformable`), the step
(trainer/step.py), the heal (admission.join), or a plan of one rank (admission.build_standin).

A plan of several ranks is a pipeline whose stage k holds whole stages of the full plan (policy/
plans.coarsen; one stage where a TP team holds them all): the cross-group reduction of shard index j
needs the same layers in every group, so a rank holds the shard indices of the full stages it merged
(`standin.StandIn(held=...)`), reduces, digests and heals each, and beats for each. Each stage is
computed by one rank or by a TP team of the full plan's degree (a full stage's TP team, all alive;
neither shards with FSDP2: each holds every FSDP2 shard's rows of its part and computes each in turn):
- one rank holds every TP index and FSDP2 shard of its full stages, slices of whole tensors
  (standin.layout), computing without TP and each FSDP2 shard's rows of a microbatch in turn (the shape
  its pipeline passes is one shard's rows): within float32 tolerance where the full plan had TP (as one
  survivor of a TP group is); where it had FSDP2 inside its stages, the stages hand each other the tied
  weight's parts apart (pipeline.Stages(apart=True)), to be summed in float64 as the full plan did;
- a TP team's rank t holds TP index t of them: TP is applied to the whole model over the plan's mesh
  before the stand-in takes its parameters (their DTensors' local shards are rank t's slices, and with
  FSDP2 in the full plan each shard f's rows of those are index (s x shards + f) x tp + t), then the
  pipeline split prunes it.
Bitwise under --exact wherever the TP degree is kept, as one rank holding every stage is (standin.py):
the same kernels per microbatch, the tied weight's two float32 parts summed once across the first and
last stage (apart, in float64, after FSDP2), dropout re-seeded at every full stage's first block and
every FSDP2 share. Another TP or FSDP2 degree is refused (replan.reformable): its slices would not be
shard index j's.

Why the survivors re-initialise the default process group rather than add a group beside it: torch's
PipelineStage needs a registered group, and the old default group is broken (a peer died). With gloo,
destroy_process_group returns at once with the dead peer (10-20 ms in a 3-process probe with a peer
SIGKILLed, init_process_group of the new one under 10 ms); the worker logs the whole as `regroup`.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import DistStoreError, PrefixStore

from unbroken.config import Config
from unbroken.policy.replan_plans import full_plan
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination
from unbroken.policy.replan_plans import plans_from
from unbroken.runtime.store.client import read
from unbroken.runtime.parallel.sockets import recorded
from unbroken.topology import Identity, Topology


@dataclass(frozen=True)
class Reform:
    """This survivor's place in its group's shrunk plan."""
    admitted: int  # the epoch that admitted the shrunk group
    stage: int  # this rank's stage in the plan
    stages: int  # the plan's stages
    merged: tuple[range, ...]  # the full plan's stages that each of the plan's stages holds
    held: tuple[int, ...] | None  # the shard indices it holds: of its stage's full stages, every TP rank's
    # (tp 1) or its own TP index's (a TP team re-formed); None: every one (one rank: admission.build_standin)
    tp: int = 1  # the plan's TP degree: 1, or the full plan's (each stage's team is a full stage's TP team)
    index: int = 0  # this rank's TP index in its stage's team

    @property
    def rank(self) -> int:
        """Its rank in the plan's process group (stage x tp + TP index, as topology.coords lays ranks out)."""
        return self.stage * self.tp + self.index

    @property
    def size(self) -> int:
        """The plan's ranks."""
        return self.stages * self.tp


def nonce(group: int, incarnation: str) -> str:
    """The one admission request of a group's survivors (every survivor names it to wait on it)."""
    return f"shrink-{group}-{incarnation}"


def agree(cfg: Config, coord: Coordination, who: Identity, leader: bool, restart: int, incarnation: str,
          wait_s: float) -> Reform | str:
    """This survivor's place in the plan the coordinator chose for its group, or why it leaves: "refused"
    (the scheduler dropped the group) or "left out" (the plan runs on other survivors). `leader`: this survivor claimed first
    (membership.claim_standin) and asks for every survivor that claimed within config parallel.claim_wait s. Call
    once per survivor, after its group broke and it released its stage; "refused" too when no admission
    comes within `wait_s` (the first survivor died before asking)."""
    request = nonce(who.group, incarnation)
    if leader:
        deadline = time.monotonic() + cfg.parallel.claim_wait
        survivors = coord.survivors(who.group_size, incarnation)
        while len(survivors) < who.group_size - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            survivors = coord.survivors(who.group_size, incarnation)
        coord.ask_to_join(request, restart, survivors)
    try:
        admitted = coord.admitted(request, wait_s)
    except DistStoreError:  # nobody asked (the first survivor died first): the group is out
        return "refused"
    if admitted < 0:
        return "refused"
    plan = plans_from(read(coord.store, keys.shrunk())).get(who.group)
    mine = [k for k, team in enumerate(plan.teams) if who.rank in team] if plan is not None else []
    if not mine:
        return "left out"
    full = full_plan(cfg.topology(), cfg.model.n_layer).layer_ranges()
    merged = tuple(range(min(j for j, r in enumerate(full) if r.start >= new.start),
                         max(j for j, r in enumerate(full) if r.stop <= new.stop) + 1)
                   for new in plan.layer_ranges())
    # full stage s holds shard indices (s x shards + f) x tp + t: one per FSDP2 shard f and TP index t
    tp, shards = cfg.topology().tp, cfg.topology().dp_shard
    k = mine[0]
    index = plan.teams[k].index(who.rank)  # its TP index in a re-formed TP team (0 without TP)
    held = tuple((s * shards + f) * tp + t for s in merged[k] for f in range(shards)
                 for t in (range(tp) if plan.tp == 1 else (index,)))
    return Reform(admitted, k, plan.pp, merged, held if len(plan.ranks) > 1 else None, plan.tp, index)


def regroup(coord: Coordination, who: Identity, reform: Reform, backend: str, timeout_s: float) -> None:
    """Replace the broken default process group with one of the plan's ranks (`Reform.rank`), rendezvousing
    on the coordinator's store under the admission's prefix. Call once, before `build`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = PrefixStore(keys.reform_prefix(who.group, reform.admitted), coord.group_store())
    with recorded():  # shut if this group breaks too (worker.close_group)
        dist.init_process_group(backend, store=store, rank=reform.rank, world_size=reform.size,
                                timeout=datetime.timedelta(seconds=timeout_s))


def build(cfg: Config, factories, reform: Reform, device: torch.device):
    """This rank's `trainer.Parts`: the whole model (its state comes from a peer group's ranks by healing),
    tensor parallel over its team where the plan keeps TP, a stand-in of its held shard indices on it,
    pruned to its stage (the full stages it merged) and fed through the new group's pipeline, if any."""
    from unbroken.runtime.trainer.admission import compiled, optimizer_for, stage_shape
    from unbroken.runtime.parallel.parallelize import tensor_parallel
    from unbroken.runtime.parallel.pipeline import Stages, merged_bounds, split
    from unbroken.runtime.parallel.precision import prepare
    from unbroken.runtime.parallel.standin import StandIn
    from unbroken.runtime.trainer.stepwork import Parts

    torch.manual_seed(cfg.run.seed)
    model = factories.build_model(cfg).to(device)
    data = factories.data(cfg)  # after the model: its initial parameters take the seed's first draws
    plan = factories.plan_of(model)  # the modules each parallelism acts on (model/plan.py)
    topology = cfg.topology()
    pipe = dist.group.WORLD
    if reform.tp > 1:  # TP before the stand-in takes its parameters: TP replaces them with DTensors
        team = Topology(1, reform.size, tp=reform.tp, pp=reform.stages)
        model, pipe = tensor_parallel(model, team, dist.group.WORLD, device, plan)
    # unsharded: autocast rather than FSDP2's policy (bf16 with stages never re-forms: config.tree refuses it)
    model = prepare(model, cfg.parallel.mixed_precision, cfg.model.activation_checkpointing, device, plan,
                    compiled(cfg))
    # a TP rank's part: slices of whole tensors without TP, its DTensors' local shards with it; with FSDP2,
    # every shard's rows of that part (it computes each shard's rows of a microbatch in turn)
    standin = StandIn(model, topology.pp, topology.tp, topology.dp_shard, held=reform.held,
                      tensor_parallel=reform.tp > 1, plan=plan)
    stages = None
    if reform.stages > 1:
        bounds = merged_bounds(model, topology.pp, list(reform.merged), plan)
        model, tied = split(model, reform.stage, reform.stages, bounds, plan)
        shape = stage_shape(data, topology.dp_shard)  # one FSDP2 share's rows
        stages = Stages(model, reform.stage, reform.stages, pipe, tied, shape, plan.pp.hidden, plan.pp.vocab,
                        plan.loss, device, apart=topology.dp_shard > 1,  # as the full plan's FSDP2 stages add
                        extra=plan.inputs)  # the tied weight
    optimizer = optimizer_for(factories, model, cfg)
    return Parts(model, data, optimizer, dist.group.WORLD, stages, standin, plan.inputs)


def stale_parameters() -> dict:
    """After a garbage collection: the parameters (`nn.Parameter`) and their elements still alive in this
    process; called by a survivor between dropping its stage and building the whole model, where both
    should be 0 (a reference kept anywhere, a thread or a traceback, would leave its stage's weights).
    Where they are not, `held_by` says what holds the first of them (`_holder`), for the event log."""
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated aliases, which warn
        warnings.simplefilter("ignore")
        live = [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]
    found = {"parameters": len(live), "elements": sum(p.numel() for p in live)}
    return {**found, "held_by": _holder(live[0], ignore=[live])} if live else found


def _holder(obj: object, ignore: list, depth: int = 8) -> str:
    """One chain of referrers from `obj` back to a root gc can name (a frame, a module, a thread's
    target), as type names: `Parameter <- dict <- Linear <- ... <- frame run (file.py:12)`. Best
    effort, for a diagnosis only; `ignore` holds this caller's own containers."""
    import gc
    import sys
    import types

    skip = {id(x) for x in ignore} | {id(sys._getframe()), id(sys._getframe(1))}
    chain, seen = [type(obj).__name__], {id(obj)}
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(obj) if id(r) not in skip and id(r) not in seen]
        if not referrers:
            break
        frames = [r for r in referrers if isinstance(r, types.FrameType)]
        skip |= {id(referrers), id(frames)}  # they hold the next one when it is asked for its referrers
        obj = frames[0] if frames else referrers[0]
        seen.add(id(obj))
        if isinstance(obj, types.FrameType):
            code = obj.f_code
            chain.append(f"frame {code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{obj.f_lineno})")
            break
        chain.append(type(obj).__name__ + (f" {obj.__name__}" if isinstance(obj, types.ModuleType) else ""))
    return " <- ".join(chain)
