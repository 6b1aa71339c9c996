"""The model as this rank holds it: the seam between building a model and training it.

Owns: `parallelize(model, topology, group, exact, ...)`, called once by the worker on the model it built,
before the optimizer is made: the trainer, persistence and healing see only what it returns and never
assume they hold the whole model. Does not own: building the model (the user's factory), the replica
group's own process group (trainer/lifecycle.py makes it from torchrun's environment: `intra_group`), the
cross-group collectives (collectives.py) or the pipeline machinery (pipeline.py).

The topology names the degrees and the model's plan (model/plan.py: `plan_of`, or a user's) names the
modules; this module applies them, as torchtitan's `parallelize` does, and names no module of its own.
One-rank groups get the model as it is. A group of G ranks shards it with FSDP2 (`fully_shard` over a 1-D
mesh of the group's ranks: each unit of the plan, then the root, which holds the rest: for the built-in
models the embeddings and the head), the way torchtitan applies it. Gradients then leave a microbatch's
backward as this rank's shard (dim 0, torch.chunk sizes) of the sum over the group's ranks: the
reduce-scatter SUMs (gloo refuses the PREMUL_SUM that a divide factor would need unless the sum is forced:
REFERENCE.md) and in exact mode runs in float64, so a microbatch's shard is the same bits whichever group
computes it. The cross-group reduction of each shard is the trainer's (per shard index, fault tolerant).

A group of tp tensor-parallel ranks (topology.tp = group_size) applies the plan's TP styles inside each
layer (`_tensor_parallel`: attention heads and MLP units split); rank j of every group holds the same
slices. With FSDP2 beside TP (group_size = dp_shard x tp), torchtitan's 2-D (dp_shard, tp) mesh, TP
innermost: TP first over the "tp" dimension, then FSDP2 over "dp_shard" shards each rank's TP slices (dim
0); a TP team shares its shard's rows of each microbatch, and rank j's parameters are a 2-D DTensor's local
piece, the same in every group. A group of pp pipeline stages (topology.pp = group_size) instead gives rank
j stage j: the model pruned to its blocks (pipeline.split) and a schedule over the group's process group
(pipeline.Stages), which the trainer feeds the group's microbatches; rank j of every group holds the same
stage and reduces it with the others over shard index j. With both (group_size = pp x tp, rank = stage x tp
+ tp index), each stage's blocks are split over its tp ranks, and the schedule runs over the ranks of one tp
index. With FSDP2 inside the stages (group_size = pp x dp_shard, rank = stage x dp_shard + shard:
torchtitan's (pp, dp_shard) mesh), each stage's blocks are sharded over its dp_shard ranks, each fed its
shard's rows, and the schedule runs over the ranks of one shard; its reduce-scatter comes once a batch,
after the schedule's last backward (pipelining's REDUCE_GRAD), and reaches the trainer through
`reduced_shards`. All three (group_size = pp x dp_shard x tp): the (pp, dp_shard, tp) mesh, TP then FSDP2 in
each stage."""
from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import DistNetworkError, PrefixStore, ProcessGroup, Store, TCPStore

from unbroken.model.plan import ParallelPlan, has, plan_of, problems
from unbroken.runtime.store import keys
from unbroken.runtime.parallel.pipeline import Stages, split
from unbroken.runtime.parallel.precision import (autocast_forward, checkpoint_layers, compile_layers, prepare,
                                                  policy as precision_policy, stage_forward)
from unbroken.runtime.parallel.sockets import recorded
from unbroken.topology import Topology, TopologyError


def intra_group(group_size: int, timeout_s: float, env: dict[str, str] | None = None, backend: str = "gloo",
                device: torch.device | None = None, relay: Store | None = None, me: int = 0) -> ProcessGroup | None:
    """The replica group's own process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), or None for one-rank groups. Call once per process, before `parallelize`.

    Each torchrun restart attempt rendezvouses under its own prefix (`attempt{TORCHELASTIC_RESTART_COUNT}`):
    torchrun keeps its agent's store across restarts, and a restarted group that reused the keys of the
    attempt before hung in init_process_group (5 of 6 tries, REFERENCE.md). A membership change (a
    replaced rank's agent joining, parallel.on_rank_loss=replan) restarts workers without counting an
    attempt: those agents do not share their store, so each round's rank 0 serves a fresh one.
    `backend`: device.backend's ("gloo"; on a GPU "cpu:gloo,cuda:nccl"); `device`: the rank's bound GPU,
    given to NCCL up front (device_id) so that its communicator is on that device, not on GPU 0.
    `relay` (the coordinator's store) and `me` (the group): where the group's rank 0 serves the store when
    its agent does not share one (`unshared_store`); without a relay, at torchrun's MASTER_PORT."""
    if group_size == 1:
        return None
    env = dict(os.environ if env is None else env)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise TopologyError(f"group_size={group_size} needs torchrun's environment ({', '.join(missing)} unset)")
    timeout = datetime.timedelta(seconds=timeout_s)
    # torchrun's agent serves the workers' store unless told not to share it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
    # set for per-rank agents: launch.py says why); then rank 0 serves it, as env:// would
    unshared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "False"
    serve = unshared and env["RANK"] == "0"
    store = unshared_store(env, timeout, relay, me) if unshared and relay is not None else \
        TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=serve, timeout=timeout)
    # Unshared, each rendezvous round's rank 0 serves a fresh store on a fresh port, and the group's agents
    # count restarts apart (a rank its own agent restarted is attempt 1, the peer that agent's rendezvous
    # restarted for a membership change still attempt 0): one prefix, or the two never meet
    restart = 0 if unshared else int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = PrefixStore(keys.attempt_prefix(restart, env.get("TORCHELASTIC_RUN_ID", "")), store)
    gpu = device if device is not None and device.type == "cuda" else None
    with recorded():  # a survivor shuts them (sockets.py): a peer blocked on it wakes
        dist.init_process_group(backend, store=attempt, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                                timeout=timeout, device_id=gpu)
    return dist.group.WORLD


def unshared_store(env: dict[str, str], timeout: datetime.timedelta, relay: Store, me: int) -> TCPStore:
    """The store of group `me`'s rendezvous round where its agent shares none: rank 0 serves it at torchrun's
    MASTER_PORT or, where another process took that port since the agent found it free (torchrun's
    get_free_port closes its probe socket: EADDRINUSE, and the group would die before its first step), at a port the OS gives it; it says which port in `relay` and the other ranks connect there.
    Call once per process; raises DistNetworkError if no store forms within `timeout`."""
    key = keys.group_store_port(me, env.get("TORCHELASTIC_RUN_ID", ""), f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    if env["RANK"] == "0":
        try:
            store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=True, timeout=timeout)
        except DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            store = TCPStore(env["MASTER_ADDR"], 0, is_master=True, timeout=timeout)  # 0: the OS picks one
        relay.set(key, str(store.port))
        return store
    relay.wait([key], timeout)
    return TCPStore(env["MASTER_ADDR"], int(relay.get(key)), is_master=False, timeout=timeout)


def parallelize(model: nn.Module, topology: Topology, group: ProcessGroup | None = None, exact: bool = False,
                rank: int = 0, shape: tuple[int, int] | None = None, device: torch.device | None = None,
                mixed_precision: str = "off", checkpointing: str = "none", plan: ParallelPlan | None = None,
                custom: Callable[..., nn.Module] | None = None,
                compile_backend: str | None = None) -> tuple[nn.Module, Stages | None]:
    """(The module this rank trains, its pipeline stage or None). Call once, after the model's construction
    (seeded: identical on every rank) and before building the optimizer over the module's parameters.
    `group` is the replica group's own process group (`intra_group`; None for one-rank groups); `rank`
    this rank's index in it; `shape` (rows, tokens) of every microbatch, needed when topology.pp > 1 (the
    stages pass activations of one static shape); `device` the rank's (the model already on it; CPU when
    None). `mixed_precision` ("bf16" or "off") and `checkpointing` ("none", "full", "selective"): what
    precision.py applies, checkpointing after TP and before FSDP2, bf16 through FSDP2's policy where it
    shards the model and autocast where it does not. `plan`: the modules each parallelism acts on
    (`plan_of(model)` when None). `custom`: a user's torchtitan-style parallelize(model, mesh, dims) that
    applies FSDP2 and TP itself in place of the plan's (`_custom`). `compile_backend`: torch.compile each
    block with it (model.compile: precision.compile_layers, after TP and checkpointing, before FSDP2); None:
    eager. Raises TopologyError for a layout it or the plan cannot apply."""
    device = torch.device("cpu") if device is None else device
    plan = plan_of(model) if plan is None else plan
    if topology.group_size == 1:
        return prepare(model, mixed_precision, checkpointing, device, plan, compile_backend), None
    if group is None or group.size() != topology.group_size:
        raise TopologyError(f"group_size={topology.group_size} needs the replica group's process group")
    if custom is not None:
        if compile_backend:  # api.check_host refuses it first
            raise TopologyError("model.compile=true with a parallelize function: compile the blocks in it")
        return _custom(model, custom, topology, _mesh(topology, group, device), precision_policy(mixed_precision,
                                                                                                 exact)), None
    wrong = problems(model, plan, topology.tp, topology.pp)
    if wrong:
        raise TopologyError(wrong[0])
    policy = precision_policy(mixed_precision, exact)
    if topology.pp > 1:
        if shape is None:
            raise TopologyError(f"pp={topology.pp}: the stages need a static microbatch shape")
        stage, shard, _ = topology.coords(rank)
        model, tied = split(model, stage, topology.pp, plan=plan)
        pipe, sharded = group, None
        if topology.tp > 1 or topology.dp_shard > 1:
            # each stage's tp ranks split its blocks (TP first), its dp_shard teams shard them with FSDP2,
            # each fed its shard's rows of every microbatch, and stage s's (shard k, TP rank t) sends to
            # stage s+1's over the "pp" dimension's group
            mesh = _mesh(topology, group, device)
            pipe = mesh.get_group("pp")
            if topology.tp > 1:
                model = _tensor_parallel(model, plan, mesh["tp"], topology.tp)
        model = checkpoint_layers(model, checkpointing, plan)  # the stage's own blocks, inside their FSDP2 units
        if compile_backend:
            model = compile_layers(model, compile_backend, plan)
        if topology.dp_shard > 1:
            model = _fully_shard(model, plan, mesh["dp_shard"], policy)
            sharded = (shard, topology.dp_shard, policy.reduce_dtype or next(model.parameters()).dtype)
        # bf16: FSDP2's policy casts the parameters where it shards, autocast where it does not; the stage
        # sends its activations in bf16 either way
        sends = stage_forward(model, mixed_precision, device, stage == topology.pp - 1, autocast=sharded is None)
        return model, Stages(model, stage, topology.pp, pipe, tied, shape, plan.pp.hidden, plan.pp.vocab,
                             plan.loss, device, sharded, extra=plan.inputs, activations=sends)
    mesh = _mesh(topology, group, device)
    if topology.tp > 1:  # TP first, then FSDP2 over it (torchtitan's order)
        model = _tensor_parallel(model, plan, mesh["tp"], topology.tp)
    model = checkpoint_layers(model, checkpointing, plan)
    if compile_backend:
        model = compile_layers(model, compile_backend, plan)
    if topology.dp_shard > 1:
        return _fully_shard(model, plan, mesh["dp_shard"], policy), None
    return autocast_forward(model, mixed_precision, device), None


def describe(model: nn.Module, plan: ParallelPlan, stages: Stages | None) -> dict:
    """What `parallelize` left on this rank, read off the module it returned (the fields of the rank's
    `parallelized` event): `fsdp_units`, the paths of its FSDP2 units in module order ("" the root);
    `tp_sharded`, how many of its parameters a mesh's "tp" dimension splits; `stage`, its pipeline stage
    (None without); `stack`, the keys of the plan's layers container it holds (None without one); and
    `inputs`, the plan's extra inputs its forward takes; `compiled`, how many of those layers torch.compile
    wraps (model.compile). Call once, after `parallelize`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    def split_by_tp(p: torch.Tensor) -> bool:
        if not isinstance(p, DTensor):
            return False
        names = p.device_mesh.mesh_dim_names or ()
        return "tp" in names and isinstance(p.placements[names.index("tp")], Shard)

    held = plan.layer_container(model) if plan.stack and has(model, plan.stack) else None
    return {"fsdp_units": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
            "tp_sharded": sum(split_by_tp(p) for p in model.parameters()),
            "stage": stages.index if stages is not None else None,
            "stack": list(held) if held is not None else None, "inputs": list(plan.inputs),
            "compiled": sum(getattr(b, "_compiled_call_impl", None) is not None for b in (held or {}).values())}


def tensor_parallel(model: nn.Module, topology: Topology, group: ProcessGroup, device: torch.device,
                    plan: ParallelPlan) -> tuple[nn.Module, ProcessGroup]:
    """(`model` split over the "tp" dimension of `topology`'s mesh on `group`, the process group its
    pipeline runs over: the "pp" dimension's, or `group` itself without stages). For a re-formed TP team
    (replan_reform.build), on the whole model before its stand-in takes the parameters and the pipeline split
    prunes them. Call once, on every rank of `group` together (the mesh's sub-groups are collective)."""
    mesh = _mesh(topology, group, device)
    return _tensor_parallel(model, plan, mesh["tp"], topology.tp), (mesh.get_group("pp") if topology.pp > 1 else group)


def _mesh(topology: Topology, group: ProcessGroup, device: torch.device):
    """The group's device mesh: torchtitan's (pp, dp_shard, tp), TP innermost (topology.coords), its
    degrees of 1 left out. One dimension is the group itself (no new process group); several are new
    sub-groups, which every rank creates in the same order (init_device_mesh)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dims = [(n, d) for n, d in (("pp", topology.pp), ("dp_shard", topology.dp_shard), ("tp", topology.tp)) if d > 1]
    names = tuple(n for n, _ in dims)
    if len(dims) == 1:
        return DeviceMesh.from_group(group, device.type, mesh_dim_names=names)
    with recorded():
        return init_device_mesh(device.type, tuple(d for _, d in dims), mesh_dim_names=names)


def _fully_shard(model: nn.Module, plan: ParallelPlan, mesh, policy) -> nn.Module:
    """FSDP2 over `mesh` (1-D), as torchtitan applies it: each of the plan's units that `model` holds (a
    pipeline stage holds some), then the root (what is left), each reduce-scattering a SUM (`_sum`)."""
    from torch.distributed.fsdp import fully_shard

    for path in plan.fsdp:
        if has(model, path):
            _sum(fully_shard(model.get_submodule(path), mesh=mesh, mp_policy=policy))
    return _sum(fully_shard(model, mesh=mesh, mp_policy=policy))


def _custom(model: nn.Module, fn: Callable[..., nn.Module], topology: Topology, mesh, policy) -> nn.Module:
    """A user's parallelize function applied as torchtitan calls its own: fn(model, mesh, dims) -> model,
    where `mesh` is the group's DeviceMesh (dimensions "dp_shard" and "tp", those of degree 1 left out)
    and `dims` = {"dp_shard": n, "tp": n, "mp_policy": the MixedPrecisionPolicy to give fully_shard}.
    Then what the trainer needs: every FSDP2 unit reduce-scatters a SUM (`_sum`); with FSDP2 shards the
    root is an FSDP2 module, and under --exact each unit reduces in the policy's float64. Raises
    TopologyError (one line) otherwise. Not with pipeline stages (api.check_host refuses them)."""
    from torch.distributed.fsdp import FSDPModule

    if topology.pp > 1:
        raise TopologyError(f"parallel.pp={topology.pp} with a parallelize function")
    model = fn(model, mesh, {"dp_shard": topology.dp_shard, "tp": topology.tp, "mp_policy": policy})
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if topology.dp_shard > 1 and not isinstance(model, FSDPModule):
        raise TopologyError(f"parallel.group_size={topology.group_size}: the parallelize function must "
                            f"fully_shard the model's root over mesh['dp_shard'] ({topology.dp_shard} shards)")
    for unit in units:
        reduce = unit._get_fsdp_state()._mp_policy.reduce_dtype
        if policy.reduce_dtype is not None and reduce != policy.reduce_dtype:
            raise TopologyError(f"the parallelize function's fully_shard reduces in {reduce}, the run in "
                                f"{policy.reduce_dtype}: pass mp_policy=dims['mp_policy']")
        _sum(unit)
    return model


def _tensor_parallel(model: nn.Module, plan: ParallelPlan, mesh, tp: int) -> nn.Module:
    """Megatron's split of each layer, as torchtitan's `apply_tp`: the plan's styles (attention by heads,
    the MLP by its hidden units, for the built-in models) applied inside each layer `model` holds, after
    the plan's rewrite of it; each row-wise layer all-reduces its partial sums, so a layer's output is
    whole on every rank again. Modules outside the layers stay whole on every rank (their gradients come
    out the same on each). TP reorders float32 sums (a row-wise layer adds the ranks' partial sums), so a
    run stays within float32 tolerance of a one-rank run, not bitwise."""
    from torch.distributed.tensor.parallel import parallelize_module

    container = plan.layer_container(model) if plan.tp is not None else None
    if container is None:
        raise TopologyError(f"parallel.tp={tp}: the model's parallel plan has no tensor-parallel part")
    for layer in container.values():
        if plan.tp.rewrite is not None:
            plan.tp.rewrite(layer, tp)
        parallelize_module(layer, mesh, dict(plan.tp.layer))
    return model


def _sum(module: nn.Module) -> nn.Module:
    """Reduce-scatter a SUM (the trainer weighs each microbatch's loss by its share of the step's
    tokens: averaging over ranks would divide twice)."""
    module.set_force_sum_reduction_for_comms(True)
    module.set_gradient_divide_factor(1.0)
    return module


def peer_lost(error: BaseException) -> bool:
    """Whether `error`, raised in a rank of a replica group of several ranks, is its group's process group
    failing under it (a peer rank died: gloo says "Connection closed/reset by peer"; NCCL and torch raise
    DistError), not a bug in this rank: the group is out of the run, but the run goes on without it.
    The chain of causes counts: a pipeline stage wraps its backward's error ("Failed to run stage
    backward"), where a tensor-parallel all-reduce inside the stage found its peer gone."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError):
            return True
        text = str(error)
        if isinstance(error, RuntimeError) and any(s in text for s in ("gloo", "Connection closed", "Connection reset",
                                                                       "NCCL", "Timed out")):
            return True
        error = error.__cause__ or error.__context__
    return False


def release_agent(replan: bool, evicted: bool = False) -> None:
    """End this rank's own torchrun agent (our parent) with SIGKILL, where its ending would close the
    group's rendezvous: a rank under an agent of its own (`replan`: parallel.on_rank_loss=replan) with no
    restarts left. Such an agent, seeing its worker exit non-zero, closes the rendezvous (torch's
    launch_agent shuts its handler down), and no agent could join the group again: a 4-rank group's
    replacements failed with RendezvousClosedError, 56 of them in a 141 s run, after its two leaving
    survivors' agents closed it. Killed, the agent only stops its keep-alives, as a lost host's does, and
    the group can re-form with replacements. Call just before this rank exits for good (a survivor that
    leaves, a fenced rank); a no-op elsewhere (one agent per group, restarts left, no torchrun).
    `evicted`: this rank was fenced as the slow rank its group shrinks around (replan.evictions); its
    agent ends even with restarts left, since a restart in place would bring the group back on the same
    slow device, to be found slow and evicted again, once per restart: a replacement host re-forms it."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    last = restarts >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if replan and "TORCHELASTIC_RUN_ID" in os.environ and (last or evicted):
        os.kill(os.getppid(), signal.SIGKILL)


def outlive_agent_restart(replan: bool, wait_s: float = 3.0) -> None:
    """A rank of a re-formed group (trainer/replan_reform.py) whose group broke, before it exits 4: give its own torchrun
    agent `wait_s` s to stop it first, then end that agent (release_agent). Why: a re-formed group breaks
    mostly because a replacement host joined the rendezvous to grow it back, and each agent then stops its
    worker for the new round (within its 0.1 s monitor interval); a peer stopped a moment earlier breaks
    this rank's group first. Exiting at once is a failed worker: its agent, no restarts left, ends and
    closes the rendezvous, and every replacement fails to join (each slot of a 4-rank group is replaced
    again and again, the group never back). Stopped by its agent, this process ends here (SIGTERM's
    default action); not stopped (a peer really lost), its agent ends without closing the rendezvous, and
    the launcher replaces it. A no-op outside a torchrun agent of its own (`replan`)."""
    if replan and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(wait_s)
        release_agent(replan)


def reduced_shards(model: nn.Module, sink) -> None:
    """Have `sink(param, shard)` called with each parameter's shard of the group's reduce-scatter output,
    in the reduce dtype (float64 under `--exact`), before FSDP2 casts it to float32 into `.grad`.

    Call once, after `parallelize`, for a model of several ranks. Why: the float64 sum of a batch of
    microbatches over the group's ranks is exact, and FSDP2 rounds it to float32 when it writes `.grad`:
    taken here, the trainer sums batches in float64 and rounds once per step, whatever batches a failure
    regroups the microbatches into (REFERENCE.md: bit-equal to the float64 sum of every rank's gradient).
    Reads FSDP2's parameter group (torch 2.13): the flat output holds each parameter's shard at offsets
    of its padded shard size, in the group's parameter order; a layout that does not add up raises."""
    from torch.distributed.fsdp import FSDPModule

    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue

        def hook(output: torch.Tensor, group=group) -> None:
            offset = output.storage_offset()
            for fp in group.fsdp_params:  # every parameter has a gradient here (trainable, all used)
                sink(fp.sharded_param, torch.as_strided(output, size=fp.sharded_size,
                                                        stride=fp.contiguous_sharded_stride, storage_offset=offset))
                offset += fp.padded_sharded_param_size.numel()
            if offset - output.storage_offset() != output.numel():
                raise RuntimeError(f"FSDP2's reduce-scatter output holds {output.numel()} elements, its "
                                   f"parameters' padded shards {offset - output.storage_offset()}")

        unit.set_all_reduce_hook(hook)
