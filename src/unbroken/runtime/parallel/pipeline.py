"""Pipeline parallelism inside a replica group: a model's layers split over the group's ranks as its plan
says (model/plan.py: `PipelinePlan`), and a batch of microbatches fed through them with
`torch.distributed.pipelining`.

Owns: `split` (prune a model to one stage's part, parameter names kept, as torchtitan's pipeline split
does) and `Stages` (this rank's `PipelineStage` and schedule over the group's own process group; the
plan's extra inputs handed to every stage's forward as keywords; each microbatch's parameter gradients
handed to a sink one by one; the tied embedding/head weight, held by the first and the last stage, summed
per microbatch across them). Does not own: which microbatches (policy),
the accumulator they go into (parallel/accumulator.py, the trainer's), the cross-group reduction (rank j of every
group holds stage j and all-reduces its gradients with the others over shard index j: collectives.py).

Why per-microbatch gradients go to a sink (a post-accumulate-grad hook on each parameter takes the
microbatch's float32 gradient and clears `.grad`) rather than letting the schedule accumulate into
`.grad`: a schedule sums a batch's microbatches in float32, so the sum's rounding would depend on how the
step's microbatches were batched over groups (and regrouped by a retry): for 4 microbatches of the default
GPT in 2 groups of 2, 31,767 of 120,576 gradient elements then differ from the float64 sum rounded once
(measured, step 0, dropout 0). Taken one by one into the float64
accumulator (--exact), a stage's gradient is the same float64 sum of the same float32 per-microbatch
gradients as a one-rank group's, whatever the assignment, and the whole batch still runs as one schedule
(the stages overlap), where a schedule per microbatch would idle every stage but one.

Why the tied weight is exchanged per microbatch: a one-rank GPT's autograd sums the embedding's and the
head's gradient of one microbatch in float32 (g_head + g_emb, then into float64); a pipeline holds them on
two ranks. Each stage keeps its float32 part of each microbatch (shape (n, vocab, C) for n microbatches),
one all-reduce over the group sums them (two float32 addends: the same bits in either order), and each
microbatch's sum goes to the sink in order, on both stages: both copies then see the same gradient and
stay equal through the optimizer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from unbroken.model.data import Microbatch
from unbroken.model.plan import ParallelPlan, plan_of
from unbroken.runtime.parallel.accumulator import unique_parameters
from unbroken.topology import TopologyError


Tied = list[tuple[tuple[str, ...], tuple[int, ...]]]  # (names sharing one tensor, its shape)


def split(model: nn.Module, stage: int, stages: int, bounds: list[int] | None = None,
          plan: ParallelPlan | None = None) -> tuple[nn.Module, Tied]:
    """Prune `model` in place to pipeline stage `stage` of `stages` and return (it, the tied names).
    `bounds`: where each stage's layers start, then the layer count (`merged_bounds`); the even split
    when None. `plan`: the model's (`plan_of(model)` when None).

    Stage 0 keeps the plan's `first` modules, the last stage its `last` ones (the others are set to
    None); layers go in contiguous runs of the layers container, earlier stages taking one more when they
    do not divide evenly. Tied: the groups of parameter names that share one tensor in the whole model
    (an embedding and a head tied to it) and its shape, for `Stages` to sum across stages.
    Raises TopologyError for a model its plan cannot split."""
    plan = _pipeline_plan(model, stages, plan)
    bounds = _bounds(model, stages, plan) if bounds is None else bounds
    by_tensor: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), ([], tuple(p.shape)))[0].append(name)
    tied = [(tuple(names), shape) for names, shape in by_tensor.values() if len(names) > 1]
    layers = plan.layer_container(model)
    for key in list(layers.keys()):
        if not bounds[stage] <= int(key) < bounds[stage + 1]:
            del layers[key]
    pruned = (plan.pp.first if stage > 0 else ()) + (plan.pp.last if stage < stages - 1 else ())
    for path in pruned:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, None)
    return model, tied


def _pipeline_plan(model: nn.Module, stages: int, plan: ParallelPlan | None) -> ParallelPlan:
    """`plan` (or the model's), checked to have a pipeline part; TopologyError otherwise."""
    plan = plan_of(model) if plan is None else plan
    if plan.pp is None or not plan.stack:
        raise TopologyError(f"parallel.pp={stages}: the model's parallel plan has no pipeline part")
    return plan


def _bounds(model: nn.Module, stages: int, plan: ParallelPlan) -> list[int]:
    """Layer index where each stage starts, then the number of layers: contiguous runs, earlier stages
    taking one more when they do not divide evenly."""
    n = len(plan.layer_container(model))
    if not 1 <= stages <= n:
        raise TopologyError(f"parallel.pp={stages}: the model has {n} layers")
    return [s * (n // stages) + min(s, n % stages) for s in range(stages + 1)]


def merged_bounds(model: nn.Module, stages: int, merged: list[range], plan: ParallelPlan | None = None) -> list[int]:
    """The `bounds` of a pipeline whose stage k is the full split's stages `merged[k]` (consecutive, in
    order, covering 0 .. stages-1 once): a group's surviving ranks re-formed into fewer stages, each
    holding whole stages of the full split (policy.plans.coarsen says why). Raises TopologyError
    otherwise. Call on the whole model, before `split`."""
    if [j for r in merged for j in r] != list(range(stages)) or any(len(r) == 0 for r in merged):
        raise TopologyError(f"stages {[list(r) for r in merged]} do not merge the {stages} stages in order")
    full = _bounds(model, stages, _pipeline_plan(model, stages, plan))
    return [full[r.start] for r in merged] + [full[-1]]


def stage_of(name: str, stages: int, bounds: list[int], plan: ParallelPlan) -> int | None:
    """The stage that holds parameter `name` of the whole model under `bounds`; None for one in no stage."""
    if plan.stack and name.startswith(plan.stack + "."):
        index = int(name[len(plan.stack) + 1:].partition(".")[0])
        return next(s for s in range(stages) if bounds[s] <= index < bounds[s + 1])
    if any(name.startswith(m + ".") for m in plan.pp.first):
        return 0
    if any(name.startswith(m + ".") for m in plan.pp.last):
        return stages - 1
    return None


def stage_names(model: nn.Module, stage: int, stages: int, plan: ParallelPlan | None = None) -> list[str]:
    """The parameter names `split(model, stage, stages)` would keep, in the order its `unique_parameters`
    lists them (a tied weight under the name this stage holds it by), without pruning anything: what a
    rank holding several stages (standin.py) reduces, digests and heals as shard index `stage`."""
    plan = _pipeline_plan(model, stages, plan)
    bounds = _bounds(model, stages, plan)
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        held = stage_of(name, stages, bounds, plan)
        if held is None:
            raise TopologyError(f"parallel.pp={stages}: parameter {name!r} belongs to no stage")
        if p.requires_grad and held == stage and id(p) not in seen:  # a stage holds a tied tensor once
            seen.add(id(p))
            out.append(name)
    return out


class Stages:
    """This rank's pipeline stage. Build once, after `split`; set `sink` before the first `run`."""

    def holds_tied(self, p: torch.Tensor) -> bool:
        """Whether `p` is this stage's copy of a weight tied across stages (each copy holds the sum)."""
        return id(p) in self._tied_ids

    def __init__(self, model: nn.Module, stage: int, stages: int, group: dist.ProcessGroup,
                 tied: Tied, shape: tuple[int, int], width: int, vocab: int,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device | None = None,
                 sharded: tuple[int, int, torch.dtype] | None = None, apart: bool = False,
                 extra: tuple[str, ...] = (), activations: torch.dtype = torch.float32):
        """`shape`: (rows, tokens) of every microbatch; `width`: the hidden size C passed between stages;
        `vocab`: the last stage's output size; `loss(output, targets)`: a microbatch's mean loss; `device`:
        the rank's (the model already on it; CPU when None); `sharded`: (this rank's FSDP shard, the
        shards, the reduce dtype) when FSDP2 shards the stage (parallelize): gradients then reach
        `took_shard` once a batch, as the reduce-scatter leaves them (parallelize.reduced_shards), not
        one microbatch at a time; `apart`: hand the sink each stage's float32 part of a tied weight's
        gradient, not their float32 sum (a pipeline re-formed from a group whose full plan had FSDP2 inside
        its stages, trainer/replan_reform.py: that plan added the parts in float64, `_sum_tied_shards`);
        `extra`: the microbatch fields beyond x and y that the model's forward takes as keywords (its
        plan's `inputs`), handed to every stage's forward (`_keywords`); `activations`: the dtype of the
        hidden states passed between stages and of their gradients (bf16 under parallel.mixed_precision:
        precision.stage_forward casts what a stage sends), the last stage's logits float32 either way."""
        from torch.distributed.pipelining import PipelineStage

        self.model, self.index, self.stages, self.group = model, stage, stages, group
        self.first, self.last = stage == 0, stage == stages - 1
        B, T = shape
        device = self.device = torch.device("cpu") if device is None else device
        # Shapes given up front: the stage's metadata is static, so no schedule ever runs an inference
        # forward/backward of its own (it would call the loss and touch .grad outside our accounting).
        # Hidden states carry gradients (requires_grad: the stage derives the gradients' buffers from it).
        inputs = (torch.empty(B, T, dtype=torch.int64, device=device) if self.first
                  else torch.empty(B, T, width, dtype=activations, device=device, requires_grad=True))
        outputs = torch.empty(B, T, vocab if self.last else width, dtype=torch.float32 if self.last else activations,
                              device=device, requires_grad=True)
        self.stage = PipelineStage(model, stage, stages, device, input_args=inputs, output_args=outputs, group=group)
        self.loss = loss
        self.sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # (parameter, its gradient)
        names = dict(model.named_parameters())
        # the tied tensors this stage holds a copy of, and each group's shape (a stage without one adds zeros)
        self.tied = [(next((names[n] for n in group if n in names), None), shape_of) for group, shape_of in tied]
        self._tied_ids = {id(p) for p, _ in self.tied if p is not None}
        self._stash: dict[int, list[torch.Tensor]] = {}
        self.sharded, self.apart, self.extra = sharded, apart, extra
        self._hooks = [] if sharded else [p.register_post_accumulate_grad_hook(self._took)
                                          for p in unique_parameters(model)]
        self._hooks += [model.register_forward_pre_hook(self._before_forward),
                        model.register_forward_hook(self._after_forward)]
        self.before: Callable[[int], None] | None = None  # set by `run` for its duration
        self.after: Callable[[int], None] | None = None
        self._schedule = None
        self._n = 0  # microbatches the schedule was built for
        self._forwards = self._losses = 0
        self._weights: list[float] = []

    def run(self, microbatches: list[Microbatch], weights: list[float], before: Callable[[int], None],
            after: Callable[[int], None]) -> list[torch.Tensor]:
        """Forward and backward `microbatches` (the group's quota, or the microbatches a retry redoes)
        through the pipeline: every rank of the group calls this with the same microbatches, in the same
        order. Each microbatch's loss is `loss(...) * weights[k]` (its tokens over the step's); every
        parameter gradient goes to `sink` microbatch by microbatch, in order. `before(k)` / `after(k)` run
        around this stage's forward of microbatch k. Returns the weighted losses on the last stage (one
        tensor per microbatch, in order), [] on the others."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        n = len(microbatches)
        if n != self._n:  # a schedule is built for a number of microbatches; quotas and retries vary it
            # 1F1B keeps at most `stages` microbatches' activations alive; it needs n >= stages, GPipe not
            kind = Schedule1F1B if n >= self.stages else ScheduleGPipe
            self._schedule, self._n = kind(self.stage, n, loss_fn=self._loss, scale_grads=False), n
        self.before, self.after, self._weights = before, after, weights
        self._forwards = self._losses = 0
        self._stash = {id(p): [] for p, _ in self.tied if p is not None}
        losses: list[torch.Tensor] = []
        keywords = self._keywords(microbatches)
        if self.first:
            self._schedule.step(torch.cat([mb.x for mb in microbatches]).to(self.device), return_outputs=False,
                                **keywords)
        elif self.last:
            self._schedule.step(target=torch.cat([mb.y for mb in microbatches]).to(self.device), losses=losses,
                                return_outputs=False, **keywords)
        else:
            self._schedule.step(return_outputs=False, **keywords)
        if self._forwards != n or (self.last and self._losses != n):
            raise RuntimeError(f"pipeline stage {self.index}: {self._forwards} forwards, {self._losses} losses "
                               f"for {n} microbatches")
        if self.sharded:
            self._sum_tied_shards()
        else:
            self._sum_tied(n)
        self.before = self.after = None
        return [loss.detach() for loss in losses]

    def evaluate(self, mb: Microbatch) -> torch.Tensor | None:
        """A forward of one microbatch through the pipeline, no backward (validation: every rank of the group
        calls it with the same microbatch, its shard's rows of it); the last stage's mean loss, None on the
        others. The training schedule is built again at the next `run`: a schedule prepares the stage for
        its own number of microbatches."""
        from torch.distributed.pipelining import ScheduleGPipe

        schedule = ScheduleGPipe(self.stage, 1, loss_fn=self.loss, scale_grads=False)
        self._schedule, self._n = None, 0
        keywords, losses = self._keywords([mb]), []
        if self.first:
            schedule.eval(mb.x.to(self.device), **keywords)
        elif self.last:
            schedule.eval(target=mb.y.to(self.device), losses=losses, **keywords)
        else:
            schedule.eval(**keywords)
        return losses[0].detach() if self.last else None

    def _keywords(self, microbatches: list[Microbatch]) -> dict[str, torch.Tensor]:
        """The extra inputs of a schedule's batch: each of `extra` that the microbatches hold, their rows
        concatenated in order as x's are, which the schedule splits back into one microbatch's rows per
        forward (torch.tensor_split along dim 0) and hands to this stage's forward as a keyword, on every
        stage: position ids (each block's RoPE) and masks act inside the layers of every stage, where x
        reaches the first only. A field that some microbatches hold and others do not raises."""
        out = {}
        for name in self.extra:
            values = [getattr(mb, name, None) for mb in microbatches]
            if all(v is None for v in values):
                continue  # the data has none (positions without document boundaries): the model's default
            if any(v is None for v in values):
                raise RuntimeError(f"pipeline stage {self.index}: input {name!r} missing from some microbatches")
            out[name] = torch.cat(values).to(self.device)
        return out

    def close(self) -> None:
        """Drop what a schedule interrupted by a peer's loss left behind (the forward outputs it kept for
        their backward) and this stage's hooks on the parameters and the model: held from C++, which the
        garbage collector cannot see through, they kept the stage alive (measured: all 14 parameters of
        stage 0 after the trainer was gone). Call
        once, when this rank leaves its pipeline for good; the stage is unusable after."""
        self.stage.clear_runtime_states()
        for hook in self._hooks:  # a parameter's hooks live in C++: a cycle through them is never collected
            hook.remove()
        self._schedule = self.sink = self.before = self.after = None
        self._stash, self._hooks = {}, []

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule calls this once per microbatch, in order (GPipe and 1F1B forward in order)."""
        weighted = self.loss(output, targets) * self._weights[self._losses]
        self._losses += 1
        return weighted

    def _before_forward(self, _module, _args) -> None:
        if self.before is not None:
            self.before(self._forwards)

    def _after_forward(self, _module, _args, _output) -> None:
        if self.after is not None:  # inside `run`: microbatch `_forwards` is through this stage
            self.after(self._forwards)
            self._forwards += 1

    def _took(self, p: torch.Tensor) -> None:
        """After autograd accumulated one microbatch's gradient into p.grad (None before: we clear it)."""
        g, p.grad = p.grad, None
        if id(p) in self._tied_ids:
            self._stash[id(p)].append(g)
        else:
            self.sink(p, g)

    def took_shard(self, p: torch.Tensor, shard: torch.Tensor) -> None:
        """A batch's reduce-scattered gradient shard of p (FSDP2 inside the stage: the reduce dtype, float64
        under --exact), once per `run`, after the schedule's last backward; a tied weight's waits for
        `_sum_tied_shards` (a copy: the reduce-scatter's buffer is FSDP2's)."""
        if id(p) in self._tied_ids:
            self._stash[id(p)].append(shard.clone())
        else:
            self.sink(p, shard)

    def _sum_tied_shards(self) -> None:
        """FSDP2 inside the stages: the tied weight's two batch sums, one per stage holding it, added over
        the stages of this FSDP shard (its rows of the embedding and of the head are the same rows: the
        same shape sharded the same way), so both copies get the same gradient. Two addends: the same bits
        in either order; but the batch's per-stage sums, not each microbatch's float32 sum as one model
        makes it, so within float32 tolerance of a one-rank run, bitwise its own topology's."""
        shard, shards, dtype = self.sharded
        for p, shape in self.tied:
            if p is not None:
                if len(self._stash[id(p)]) != 1:
                    raise RuntimeError(f"pipeline stage {self.index}: {len(self._stash[id(p)])} reduce-scatters "
                                       f"of a tied weight in one schedule")
                part = self._stash[id(p)][0]
            else:  # a middle stage: its zeros of this shard's rows (torch.chunk's split, as FSDP2's dim-0 shards)
                rows = [len(c) for c in torch.empty(shape[0]).chunk(shards)] + [0] * shards
                part = torch.zeros(rows[shard], *shape[1:], dtype=dtype, device=self.device)
            dist.all_reduce(part, group=self.group)
            if p is not None:
                self.sink(p, part)

    def _sum_tied(self, n: int) -> None:
        for p, shape in self.tied:
            parts = torch.stack(self._stash[id(p)]) if p is not None else torch.zeros(n, *shape, device=self.device)
            if parts.shape[0] != n:
                raise RuntimeError(f"pipeline stage {self.index}: {parts.shape[0]} gradients of a tied weight "
                                   f"for {n} microbatches")
            if self.apart:  # every stage's (n, *shape) float32 parts, each to the sink: its float64 sum adds them
                every = [torch.empty_like(parts) for _ in range(dist.get_world_size(self.group))]
                dist.all_gather(every, parts, group=self.group)
                for k in range(n if p is not None else 0):
                    for part in every:
                        self.sink(p, part[k])
                continue
            dist.all_reduce(parts, group=self.group)  # (n, *shape) float32: each microbatch's two parts summed
            if p is not None:
                for g in parts:
                    self.sink(p, g)

