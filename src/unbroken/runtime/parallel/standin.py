"""A shrunk replica group: one rank that holds every shard index of its group's plan (the whole model of
a pipeline, tensor-parallel or FSDP2 group that lost a rank), so that it keeps reducing, digesting and
healing per shard index exactly as the full group did.

Owns: which part of the whole model's parameters makes up each shard index (`layout`, of `Slice`s: the
stage's parameters, as `pipeline.split` leaves them; of each, the TP rank's rows or columns of a split
layer, as `parallelize._tensor_parallel` leaves them, the rest whole; and of that, the FSDP2 shard's rows,
torch.chunk's along dim 0, as `fully_shard` cuts a rank's local tensor); the accumulator that files
each microbatch's gradient under every shard index holding a part of it (`ShardedAccumulator`); the state a
shard index heals with (`StandIn.heal_tensors`); the forward hook that re-seeds a microbatch's dropout at
each stage boundary, as a pipeline's stages each seed it. Does not own: deciding to shrink
(policy/replan_scheduler.py, asked by the coordinator: coordinator/replan.py), the step (trainer/step.py), or the transfer
(persist/healing.py, called once per shard index).

Why one rank can stand in bitwise for a pipeline (`--exact`): a microbatch's gradient of each parameter is
the same float32 tensor whether its stage's layers run alone or inside the whole model (same kernels,
same inputs); the tied embedding/head weight's per-microbatch gradient is the sum of its two float32
parts either way (autograd sums them here, one all-reduce over the stages there: two addends, the same
bits in either order); and every shard index still sums the same per-microbatch gradients in float64,
in microbatch order, before the cross-group all-reduce of that shard index. For FSDP2 shards too: the
trainer computes each shard's rows of a microbatch in turn, as that shard's rank did (the same rows,
kernels and dropout seed), and each shard index sums in float64 the float32 gradients that the group's
float64 reduce-scatter summed (float32 addends, exact in float64 in any order). Not for one rank holding
a pipeline of FSDP2 stages: there the stages add the tied weight's two uses per batch in float64
(pipeline._sum_tied_shards), here autograd adds them per microbatch in float32 (a re-formed pipeline of
several ranks hands the stages' parts over apart instead, and is bitwise: trainer/replan_reform.py). For tensor parallelism it
cannot: the whole model's matmuls add over all heads and units at once where TP ranks add partial sums,
so a shrunk TP group is within float32 tolerance of the TP trajectory, not on it (and with dropout > 0
its masks differ: one stream over all heads here, one per rank's heads there).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from unbroken.model.data import seed_microbatch
from unbroken.model.plan import ParallelPlan, plan_of
from unbroken.runtime.parallel.accumulator import Accumulator, local
from unbroken.runtime.parallel.pipeline import stage_names
from unbroken.topology import TopologyError


@dataclass(frozen=True)
class Slice:
    """Shard index j's part of one parameter of the whole model: all of it (`index` None), or the entries
    at `index` along `dim` (a TP rank's rows of a column-wise layer, columns of a row-wise one; an FSDP2
    shard's rows), and of those the rows `rows` where both split it (FSDP2 shard k of a TP rank's columns)."""
    param: nn.Parameter
    dim: int = 0
    index: torch.Tensor | None = None
    ghost: torch.Tensor | None = None  # what the accumulator files this part under: `param` when whole
    rows: torch.Tensor | None = None  # dim-0 entries of the `index` part (only with dim 1)

    @property
    def whole(self) -> bool:
        return self.index is None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This part of `t` (the parameter, its gradient or a state tensor shaped like it): `t` itself when
        whole, else a copy (of its local tensor where it is a DTensor: a re-formed TP team's FSDP2 rows)."""
        if self.whole:
            return t
        t = local(t)
        if t.shape != local(self.param).shape:
            return t
        part = t.index_select(self.dim, self.index)
        return part if self.rows is None else part.index_select(0, self.rows)

    def put(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """Write `part` (as `take` gave it) back into `full`."""
        if part is not full:
            with torch.no_grad():
                if self.whole or full.shape != local(self.param).shape:
                    full.copy_(part)
                elif self.rows is None:
                    full.index_copy_(self.dim, self.index, part)
                else:
                    columns = full.index_select(self.dim, self.index)
                    columns.index_copy_(0, self.rows, part)
                    full.index_copy_(self.dim, self.index, columns)


def layout(model: nn.Module, pp: int = 1, tp: int = 1, shards: int = 1,
           plan: ParallelPlan | None = None) -> list[list[Slice]]:
    """Every shard index's part of the whole model, in topology.coords' rank order (rank = (stage x shards
    + FSDP2 shard) x tp + TP index), each in the order that rank lists its parameters: stage s's (all of
    them when pp is 1; pipeline.stage_names), TP rank t's part of each (`_tp_part`), and FSDP2 shard k's
    rows of that part (torch.chunk's k-th along dim 0, as fully_shard cuts a rank's local tensor; the last
    shard's rows fewer, or none, where dim 0 does not divide). `plan`: the model's (`plan_of` when None),
    whose TP part says how a TP rank's part of each parameter is cut."""
    plan = plan_of(model) if plan is None else plan
    if tp > 1 and (plan.tp is None or not plan.stack):
        raise TopologyError(f"parallel.tp={tp}: the model's parallel plan has no tensor-parallel part")
    named = dict(model.named_parameters(remove_duplicate=False))
    names = [stage_names(model, st, pp, plan) for st in range(pp)] if pp > 1 else \
        [[n for n, p in model.named_parameters() if p.requires_grad]]
    return [[_part(n, named[n], t, tp, k, shards, plan) for n in names[st]]
            for st in range(pp) for k in range(shards) for t in range(tp)]


def _part(name: str, p: nn.Parameter, t: int, tp: int, k: int, shards: int, plan: ParallelPlan) -> Slice:
    """TP rank t's part of parameter `name`, and of it FSDP2 shard k's rows."""
    dim, index = _tp_part(name, p, t, tp, plan) if tp > 1 else (0, None)
    rows = None
    if shards > 1:
        # dim 0 of the TP rank's tensor (its local one where TP already split it: a re-formed TP team)
        n = len(index) if index is not None and dim == 0 else local(p).shape[0]
        step = -(-n // shards)  # torch.chunk's chunk size
        rows = torch.arange(min(k * step, n), min((k + 1) * step, n))
        if index is None or dim == 0:  # one cut along dim 0: the shard's rows of the rank's rows
            dim, index, rows = 0, rows if index is None else index[rows], None
    if index is None:
        return Slice(p, ghost=p)
    shape = list(local(p).shape)
    shape[dim] = len(index)
    if rows is not None:
        shape[0] = len(rows)
        rows = rows.to(p.device)
    return Slice(p, dim, index.to(p.device), torch.empty(shape, dtype=p.dtype, device=p.device), rows)


def _tp_part(name: str, p: nn.Parameter, j: int, tp: int, plan: ParallelPlan) -> tuple[int, torch.Tensor | None]:
    """(dim, index) of TP rank j's part of parameter `name` (the split `parallelize._tensor_parallel`
    makes, as the plan's `TensorPlan.part` cuts it) for a parameter inside a layer; everything else whole
    (embeddings, norms, the head: replicated on every TP rank)."""
    prefix = plan.stack + "."
    if not name.startswith(prefix):
        return 0, None
    inside = name[len(prefix):].partition(".")[2]  # the path inside its layer: "attn.qkv.weight"
    return plan.tp.part(inside, tuple(p.shape), j, tp)


class ShardedAccumulator:
    """One `Accumulator` per shard index over that shard's parts, with the interface the trainer uses.
    Gradients arrive through `add_shard` (the hooks of `StandIn.attach`), one microbatch at a time; the
    weighted loss of FSDP2 share k's rows goes to shard index `loss_shards[k]` (the last stage's TP index 0
    of shard k counts it, as its rank does: the whole microbatch's is share 0's without FSDP2)."""

    def __init__(self, layout: list[list[Slice]], dtype: torch.dtype, params: list[nn.Parameter],
                 loss_shards: tuple[int, ...]):
        self.layout, self.params, self.loss_shards = layout, params, loss_shards
        self.parts = [Accumulator([s.ghost for s in shard], dtype, hooked=True) for shard in layout]
        self._holders: dict[int, list[tuple[Accumulator, Slice]]] = {id(p): [] for p in params}
        for a, shard in zip(self.parts, layout):
            for s in shard:
                self._holders[id(s.param)].append((a, s))

    @property
    def buffer(self) -> torch.Tensor:  # step.py reads its dtype and size
        return self.parts[self.loss_shards[0] if self.loss_shards else 0].buffer

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers a step reduces, one per shard index held, in `held` order."""
        return [a.buffer for a in self.parts]

    def load_reduced(self, reduced: list[torch.Tensor]) -> float:
        return self.load_grads(reduced)

    def zero(self) -> None:
        for a in self.parts:
            a.zero()

    def add(self, weighted_loss: torch.Tensor, share: int = 0) -> None:
        """After each backward: the weighted loss of FSDP2 share `share`'s rows (the whole microbatch's
        outside FSDP2) goes to its shard index."""
        for p in self.params:
            p.grad = None
        held = self.loss_shards[share] if self.loss_shards else -1  # none here: a zero in every index
        for j, a in enumerate(self.parts):
            a.add(weighted_loss if j == held else weighted_loss.new_zeros(()))

    def add_shard(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        for a, s in self._holders[id(param)]:
            a.add_shard(s.ghost, s.take(grad))

    def load_grads(self, reduced: list[torch.Tensor]) -> float:
        """Each shard index's reduced buffer into `.grad` (a whole parameter held by several shard indices
        gets the same sum from each; a sliced one is put together from its parts); returns the step's
        loss (the loss shard's slot: the others hold 0)."""
        loss = sum(a.load_grads(r) for a, r in zip(self.parts, reduced))
        for p in self.params:
            sliced = [s for _, s in self._holders[id(p)] if not s.whole]
            if sliced:
                grad = torch.empty_like(local(p))
                for s in sliced:
                    s.put(grad, s.ghost.grad)
                p.grad = Accumulator._as_grad(p, grad)  # a DTensor's where p is one (a TP team's)
        return loss


class StandIn:
    """Build once, on the whole model (after its construction, before the optimizer), for a rank that
    holds every shard index of a group of `pp` pipeline stages x `shards` FSDP2 shards x `tp` TP ranks
    (`shares`: the trainer computes each FSDP2 shard's rows of a microbatch in turn)."""

    def __init__(self, model: nn.Module, pp: int = 1, tp: int = 1, shards: int = 1,
                 held: tuple[int, ...] | None = None, tensor_parallel: bool = False, plan: ParallelPlan | None = None):
        """`held`: the shard indices this rank holds, in order, when it holds some of them (a rank of a
        group re-formed into fewer pipeline stages: the indices of the full stages its stage merged);
        every index when None. `model` is the whole model, split (pipeline.split) after this, if at all.
        `tensor_parallel`: `model` is already split over a TP team of `tp` ranks (a re-formed TP team,
        replan_reform.build), so shard index (s x shards + f) x tp + t, held by TP rank t only, is FSDP2 shard
        f's rows (torch.chunk's, as fully_shard cuts them) of stage s's parameters' local tensors: their
        DTensors' local shards are rank t's slices (all of them without FSDP2). `plan`: the model's
        (`plan_of(model)` when None)."""
        if pp * tp * shards == 1:
            raise TopologyError(f"a shrunk group stands in for several ranks (pp={pp}, tp={tp}, FSDP2 shards=1)")
        plan = plan_of(model) if plan is None else plan
        every = layout(model, pp, 1, shards, plan) if tensor_parallel else layout(model, pp, tp, shards, plan)
        if tensor_parallel:  # (stage s, FSDP2 shard f)'s rows of the local tensors under each TP index t
            every = [every[j // tp] for j in range(pp * shards * tp)]
        self.held = tuple(range(len(every))) if held is None else tuple(held)
        self.model, self.shares = model, shards
        self.layout = [every[j] for j in self.held]
        # the last stage's TP index 0 of each FSDP2 shard counts that shard's rows' loss: their positions
        # here (none when this rank does not hold the last stage: its loss is counted where it is held)
        position = self._position = {j: i for i, j in enumerate(self.held)}
        self.loss_shards = tuple(position[j] for j in (((pp - 1) * shards + k) * tp for k in range(shards))
                                 if j in position)
        self.seed: int | None = None  # the microbatch computing now (trainer.compute sets it)
        if pp > 1:
            stages = sorted({j // (shards * tp) for j in self.held})  # the full stages it holds
            names = [stage_names(model, j, pp, plan) for j in stages[1:]]  # a stage's own start is seeded by it
            prefix = plan.stack + "."
            firsts = {int(ns[0][len(prefix):].split(".")[0]) for ns in names if ns and ns[0].startswith(prefix)}
            for key, block in plan.layer_container(model).items():
                if int(key) in firsts:  # the first block of a later full stage: that stage seeded its dropout
                    block.register_forward_pre_hook(self._reseed)

    def _reseed(self, _module, _args) -> None:
        if self.seed is not None:
            seed_microbatch(self.seed)

    def accumulator(self, dtype: torch.dtype, params: list[nn.Parameter]) -> ShardedAccumulator:
        return ShardedAccumulator(self.layout, dtype, params, self.loss_shards)

    def attach(self, params: list[nn.Parameter], sink: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Hand each parameter's per-microbatch float32 gradient to `sink(param, grad)` and clear `.grad`
        (so the next microbatch's gradient is its own, not a float32 running sum). Call once."""
        def took(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None
            sink(p, g)

        for p in params:
            p.register_post_accumulate_grad_hook(took)

    def parameters(self, shard: int) -> list[torch.Tensor]:
        """Shard index `shard`'s parameters as its rank holds them (for its digests)."""
        return [s.take(s.param.detach()) for s in self.layout[self._position[shard]]]

    def heal_tensors(self, shard: int, optimizer: torch.optim.Optimizer
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
        """(its parameters, the tensors a heal moves: parameters then each one's optimizer state tensors by
        sorted key, as healing orders a rank's, and `put_back`, which writes received values into the whole
        model's tensors: call after filling them)."""
        params, tensors, homes = [], [], []
        mine = self.layout[self._position[shard]]
        for s in mine:  # local: a re-formed TP team's parameters (and their state) are DTensors
            full = local(s.param.data)
            part = s.take(full)
            params.append(part)
            tensors.append(part)
            homes.append((s, full))
        for s in mine:
            for _, v in sorted(optimizer.state.get(s.param, {}).items()):
                if torch.is_tensor(v):
                    state = local(v)
                    tensors.append(s.take(state))
                    homes.append((s, state))

        def put_back() -> None:
            for (s, full), part in zip(homes, tensors):
                s.put(full, part)

        return params, tensors, put_back
