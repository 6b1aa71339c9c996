"""A model's parallel plan: which of its modules each parallelism acts on, as the model names them.

Owns: `ParallelPlan` (FSDP2 units; the tensor-parallel styles per layer, a rewrite a layer needs first,
how a TP rank's slice of each parameter is cut and what the degree must divide; the pipeline's stages;
the loss and the extra inputs), `plan_of` (the plan a model supplies, or the plain one), `problems`
(what a plan cannot do for the requested degrees, one line each) and `reform_problem` (why a group of it
cannot re-form onto fewer ranks). Does not own: applying a plan
(runtime/parallel: meshes, `fully_shard`, `parallelize_module`, stages, stand-ins), which never names a
module of any model: every path it acts on comes from here.

The split is torchtitan's: the model file says what (its `parallelize_llama` names `wq/wk/wv` column-wise,
`wo` row-wise, one FSDP2 unit per block), the runtime says how. A plan names modules by their path in
the whole model (`nn.Module.get_submodule`); TP styles name modules by their path inside one layer.

Pipeline stages follow torchtitan's pruning: stage s keeps a contiguous run of the layers container's
entries (a ModuleDict keyed "0".."n-1", so kept layers keep their parameter names), stage 0 also the
modules of `first`, the last stage those of `last`; pruned modules are set to None and the model's own
forward skips a None module (it is each stage's forward: hidden states (B, T, hidden) in where `first` is
pruned, out where `last` is). Parameters tied across stages are found from the whole model's parameters
(one tensor under several names), not named here.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch
import torch.nn as nn

# (parameter path inside a layer, its shape, TP rank j, TP degree) -> (dim, indices) of rank j's slice, or
# None to take the slice the layer's style implies (`TensorPlan.part`)
Slicer = Callable[[str, tuple[int, ...], int, int], "tuple[int, torch.Tensor | None] | None"]


@dataclass(frozen=True)
class TensorPlan:
    """Tensor parallelism inside each layer of the layers container (Megatron's split, as torchtitan's
    `apply_tp` gives it to `parallelize_module`): module paths inside one layer (fnmatch patterns per
    dotted atom) -> torch's ParallelStyle (ColwiseParallel, RowwiseParallel, SequenceParallel,
    PrepareModuleInput...). Modules outside the layers stay whole on every TP rank."""
    layer: Mapping[str, object]
    divides: tuple[tuple[str, int], ...] = ()
    """(what, count) pairs the TP degree must divide: ("model.n_head", 4), ("model.n_kv_head", 2)."""
    rewrite: Callable[[nn.Module, int], None] | None = None
    """rewrite(layer, tp), in place, before the styles apply: a fused layer's rows reordered so that a
    column-wise split hands each rank a whole part (the GPT's [q | k | v])."""
    slicer: Slicer | None = None
    """A TP rank's slice of a parameter of the whole, un-rewritten model where the style alone does not
    say it (a rewritten layer): what a rank standing in for a TP group takes (runtime/parallel/standin)."""

    def style_of(self, path: str):
        """The style of the module at `path` inside a layer, or None."""
        atoms = path.split(".")
        for pattern, style in self.layer.items():
            keys = pattern.split(".")
            if len(keys) == len(atoms) and all(fnmatch(a, k) for a, k in zip(atoms, keys)):
                return style
        return None

    def part(self, path: str, shape: tuple[int, ...], j: int, tp: int) -> tuple[int, torch.Tensor | None]:
        """(dim, indices) of TP rank j's slice of the parameter at `path` inside a layer ("attn.wq.weight"),
        of shape `shape` in the whole model: the slicer's, else a column-wise module's rows (weight and
        bias: Shard(0) of an nn.Linear), a row-wise module's weight columns (Shard(1)); (0, None) for a
        parameter every TP rank holds whole."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        custom = self.slicer(path, shape, j, tp) if self.slicer is not None else None
        if custom is not None:
            return custom
        module, _, leaf = path.rpartition(".")
        style = self.style_of(module)
        if isinstance(style, ColwiseParallel):
            n = shape[0] // tp
            return 0, torch.arange(j * n, (j + 1) * n)
        if isinstance(style, RowwiseParallel) and leaf == "weight":
            n = shape[1] // tp
            return 1, torch.arange(j * n, (j + 1) * n)
        return 0, None


@dataclass(frozen=True)
class PipelinePlan:
    """How the model splits into pipeline stages: the modules before and after the layers container, and
    the widths passed between stages."""
    first: tuple[str, ...]
    """Module paths stage 0 holds besides its layers (the embeddings)."""
    last: tuple[str, ...]
    """Module paths the last stage holds besides its layers (the final norm, the head)."""
    hidden: int
    """The width of the hidden states a stage passes to the next: (B, T, hidden)."""
    vocab: int
    """The last stage's output width: (B, T, vocab) logits, which `ParallelPlan.loss` takes."""


@dataclass(frozen=True)
class ParallelPlan:
    """What each parallelism acts on, by module path in the whole model. Build one per model (its
    `parallel_plan()`); a value, read by runtime/parallel, never changed."""
    stack: str = ""
    """Path of the layers container, the stack of transformer blocks: a ModuleDict keyed "0".."n-1"
    (activation checkpointing wraps each, TP applies inside each, the pipeline splits them); "" for none."""
    fsdp: tuple[str, ...] = ()
    """FSDP2 units in order, each `fully_shard`ed on its own; the root follows and holds the rest."""
    tp: TensorPlan | None = None
    """Tensor parallelism; None: the model cannot run with parallel.tp > 1."""
    pp: PipelinePlan | None = None
    """Pipeline stages; None: the model cannot run with parallel.pp > 1."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """loss(logits (B, T, vocab), targets (B, T)) -> the mean loss over counted targets: a pipeline's
    last stage takes it (its forward returns logits)."""
    inputs: tuple[str, ...] = field(default=())
    """Microbatch fields beyond x and y (model/data/batch.py: "positions") that the model's forward takes
    as keyword arguments, each cut into a rank's rows with x and y; with pipeline stages every stage's
    forward gets them, a microbatch's rows each (runtime/parallel/pipeline.py: `Stages`)."""

    def layer_container(self, model: nn.Module) -> nn.ModuleDict | None:
        """The layers container of `model` (or of a pipeline stage of it), None without one."""
        if not self.stack:
            return None
        container = model.get_submodule(self.stack)
        if not isinstance(container, nn.ModuleDict):
            raise TypeError(f"the plan's stack {self.stack!r} is a {type(container).__name__}, not a ModuleDict")
        return container

    def named(self) -> list[str]:
        """Every module path the plan names in the whole model (the layers container included)."""
        pp = self.pp
        return [*([self.stack] if self.stack else []), *self.fsdp,
                *((*pp.first, *pp.last) if pp is not None else ())]


def plan_of(model: nn.Module) -> ParallelPlan:
    """The plan `model` supplies through `parallel_plan()`, or the plain one: FSDP2 over the root as one
    unit, no TP, no pipeline (any nn.Module runs in FSDP2 groups). Call on the whole model."""
    supply = getattr(model, "parallel_plan", None)
    return supply() if callable(supply) else ParallelPlan()


def has(model: nn.Module, path: str) -> bool:
    """Whether `model` holds a module at `path` (a pruned one, set to None, it does not)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def problems(model: nn.Module, plan: ParallelPlan, tp: int = 1, pp: int = 1) -> list[str]:
    """What `plan` cannot do on `model` (the whole model, on any device, meta too) at TP degree `tp` and
    `pp` stages: each one line naming the key or module. Empty: it can. Pure; call before any worker
    starts (api.check_host) and again where a worker applies the plan."""
    out = [f"the model's parallel plan names module {p!r}, which the model does not have"
           for p in plan.named() if not has(model, p)]
    if out:
        return out
    if tp > 1:
        if plan.tp is None:
            out.append(f"parallel.tp={tp}: the model's parallel plan has no tensor-parallel part")
        else:
            out += [f"parallel.tp={tp} does not divide {what}={n} (each TP rank takes whole ones)"
                    for what, n in plan.tp.divides if n % tp]
            if not plan.stack:
                out.append(f"parallel.tp={tp}: the model's parallel plan names no layers container")
    if pp > 1:
        if plan.pp is None or not plan.stack or plan.loss is None:
            out.append(f"parallel.pp={pp}: the model's parallel plan has no pipeline part (layers, stages, loss)")
        elif pp > len(plan.layer_container(model)):
            out.append(f"parallel.pp={pp}: more stages than the model's {len(plan.layer_container(model))} layers")
    return out



def reform_problem(model: nn.Module, plan: ParallelPlan, tp: int = 1) -> str | None:
    """Why a replica group running `plan` on `model` (the whole model, meta too) at TP degree `tp` cannot
    re-form onto fewer ranks after losing one (parallel.on_rank_loss=replan), None where it can. Pure;
    call before any worker starts (api.check_host), after `problems` found nothing.

    A survivor holds the lost ranks' shard indices as slices of whole tensors (runtime/parallel/standin.py),
    cut as the plan says: FSDP2 shards by torch.chunk's rows (any plan), pipeline stages by `pp` (which
    parallel.pp > 1 needs anyway), TP ranks by `TensorPlan.part`. That part is known only for torch's
    column- and row-wise styles on nn.Linear layers, and styles that leave parameters whole; a plan that
    rewrites its layers, or splits another module, must say it with a `slicer`."""
    if tp <= 1 or plan.tp is None or plan.tp.slicer is not None:
        return None
    if plan.tp.rewrite is not None:
        return ("the model's TP plan rewrites its layers (TensorPlan.rewrite) and gives no slicer: a survivor "
                "cannot cut a TP rank's part of a rewritten layer")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    container = plan.layer_container(model)
    layer = next(iter(container.values()), None) if container is not None else None
    for path, module in layer.named_modules() if layer is not None else ():
        style = plan.tp.style_of(path) if path else None
        if style is None or isinstance(style, SequenceParallel) or not any(True for _ in module.parameters(recurse=False)):
            continue  # whole on every TP rank (SequenceParallel replicates its parameters)
        if not isinstance(style, ColwiseParallel | RowwiseParallel) or not isinstance(module, nn.Linear):
            return (f"the model's TP plan gives {type(style).__name__} to {path!r} ({type(module).__name__}) "
                    f"and no slicer: a survivor cannot cut a TP rank's part of it")
    return None
