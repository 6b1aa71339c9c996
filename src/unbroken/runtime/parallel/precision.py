"""What a rank computes in and what it keeps: bf16 mixed precision, activation checkpointing, torch.compile.

Owns: the FSDP2 `MixedPrecisionPolicy` of a group of shards (`policy`), autocast around the forward of a
model FSDP2 does not wrap (`autocast_forward`: one-rank groups, tensor parallelism without shards, a
shrunk group's stand-in), torch.utils.checkpoint around each transformer block
(`checkpoint_layers`), and torch.compile of each block (`compile_layers`). Does not own: which modules are the blocks (the model's plan says: its layers container), the
order of TP, checkpointing and FSDP2 (parallelize.py applies them as torchtitan does: TP, then
checkpointing, then FSDP2), or the accumulator's dtype (accumulator.py: float32, float64 under --exact,
whatever the compute dtype).

bf16 as torchtitan runs it: parameters stay float32 (the master weights the optimizer steps, its state
float32 too); inside a group FSDP2 all-gathers them cast to bf16 and reduce-scatters the gradients in
float32 (float64 under --exact), writing float32 `.grad`; without FSDP2 autocast runs the matmuls in bf16
and autograd hands float32 gradients to the float32 leaves. The forward's floating output is widened to
float32, so the loss the trainer weighs and accumulates is float32 either way.

Checkpointing replaces a block's `forward` (an instance attribute, not a wrapper module: parameter names,
which snapshots, heals, DCP and the stand-in's layout read, stay as they are) with a non-reentrant
`checkpoint` of it. `preserve_rng_state` (the default) replays the forward's RNG state in the recompute,
so dropout draws the same masks and the gradients are bitwise those of a run without checkpointing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from unbroken.model.plan import ParallelPlan, plan_of
from unbroken.topology import TopologyError


def policy(mixed_precision: str, exact: bool):
    """FSDP2's `MixedPrecisionPolicy` for a group of shards: bf16 parameters in the forward and backward
    with float32 reduction ("bf16"), or the parameters' own dtype ("off"); float64 reduction under --exact
    either way (reduced_shards takes it before FSDP2 rounds it into .grad)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "off":
        return MixedPrecisionPolicy(reduce_dtype=torch.float64 if exact else None)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float64 if exact else torch.float32)


def autocast_forward(model: nn.Module, mixed_precision: str, device: torch.device) -> nn.Module:
    """`model` with its forward run under bf16 autocast on `device`'s type, its floating tensor output
    widened to float32 ("bf16"); `model` unchanged ("off"). Call once, on a model FSDP2 does not shard, after
    everything else that wraps it; the backward runs outside autocast, as torch recommends."""
    if mixed_precision == "off":
        return model
    forward = model.forward

    def bf16_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    model.forward = bf16_forward
    return model


def stage_forward(model: nn.Module, mixed_precision: str, device: torch.device, last: bool,
                  autocast: bool = True) -> torch.dtype:
    """A pipeline stage's forward under bf16 ("bf16"): under autocast unless FSDP2's policy casts it
    (`autocast` False), its floating output cast to bf16 on a stage that sends it on (the activations
    between stages, and their gradients coming back, travel in bf16) and widened to float32 on the last
    (its loss is float32 as elsewhere). Returns the dtype the stage sends (bf16), or float32 for "off"
    (`model` then unchanged). Call once, after FSDP2, before `Stages` (its inputs and outputs take the dtype)."""
    if mixed_precision == "off":
        return torch.float32
    forward, out_dtype = model.forward, torch.float32 if last else torch.bfloat16

    def bf16_stage_forward(*args: Any, **kwargs: Any) -> Any:
        if autocast:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        return out.to(out_dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    model.forward = bf16_stage_forward
    return torch.bfloat16


def checkpointed(mode: str, n: int) -> list[int]:
    """Indices of the blocks out of `n` (the whole model's) that `mode` checkpoints: all ("full"), every
    other one ("selective": blocks 1, 3, 5, ..., as torchtitan's layer-wise selective checkpointing with
    frequency 2 picks them), none ("none")."""
    if mode == "full":
        return list(range(n))
    if mode == "selective":
        return list(range(1, n, 2))
    return []


def checkpoint_layers(model: nn.Module, mode: str, plan: ParallelPlan | None = None) -> nn.Module:
    """`model` with each block that `mode` picks (`checkpointed`) recomputed in the backward: the entries
    of `plan`'s layers container (`plan_of(model)` when None; those a pipeline stage kept). Call once,
    before fully_shard (inside each block's FSDP2 unit, as torchtitan applies it) and after tensor
    parallelism. Raises TopologyError for a plan without layers when `mode` is not "none"."""
    if mode == "none":
        return model
    container = (plan or plan_of(model)).layer_container(model)
    if container is None:
        raise TopologyError(f"model.activation_checkpointing={mode} needs a model whose parallel plan names its "
                            f"layers")
    # a block's index in the whole model: its key where the container is keyed by layer number (a pipeline
    # stage keeps the whole model's keys), else its position; so every stage picks the same blocks the
    # whole model would
    keys = list(container)
    index = [int(k) for k in keys] if all(str(k).isdigit() for k in keys) else list(range(len(keys)))
    n = max(index) + 1 if index else 0
    picked = set(checkpointed(mode, n))
    for k, i in zip(keys, index):
        if i in picked:
            container[k].forward = _recomputed(container[k].forward)
    return model


def compile_layers(model: nn.Module, backend: str, plan: ParallelPlan | None = None) -> nn.Module:
    """`model` with each block of `plan`'s layers container (`plan_of(model)` when None; those a pipeline
    stage kept) compiled in place (`nn.Module.compile`: its `__call__`, so parameter names stay), as
    torchtitan's apply_compile compiles each TransformerBlock: after TP and activation checkpointing, before
    FSDP2. Compiled lazily, at the first forward. Raises TopologyError for a plan without layers."""
    container = (plan or plan_of(model)).layer_container(model)
    if container is None:
        raise TopologyError("model.compile=true needs a model whose parallel plan names its layers")
    if backend == "inductor":
        import torch._inductor.config as inductor

        inductor.compile_threads = 1  # compile in this process: no pool of compile workers beside each rank
    for block in container.values():
        block.compile(backend=backend)
    return model


def compile_problem(backend: str, device: str) -> str | None:
    """Why model.compile_backend=`backend` cannot run on `device` ("cpu" or "cuda") here, or None."""
    import importlib.util
    import shutil

    if backend != "inductor":
        return None
    if device == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor on a GPU needs Triton (pip install triton), or use --model.compile_backend=aot_eager"
    if device == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "inductor on the CPU needs a C++ compiler (c++, g++ or clang++ on PATH), or use " \
               "--model.compile_backend=aot_eager"
    return None


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    checkpointed_forward.recomputes = True  # what `recomputed_blocks` reads
    return checkpointed_forward


def recomputed_blocks(model: nn.Module, plan: ParallelPlan | None = None) -> list[str]:
    """The keys of the blocks of `model`'s layers container (`plan`'s, else `plan_of(model)`'s) whose
    forward recomputes its activations in the backward (`checkpoint_layers` wrapped it), in order: what this
    rank holds, read off the module it trains. [] without a container. Call once, after the model is built."""
    container = (plan or plan_of(model)).layer_container(model)
    if container is None:
        return []
    return [k for k, block in container.items() if getattr(block.forward, "recomputes", False)]


def prepare(model: nn.Module, mixed_precision: str, checkpointing: str, device: torch.device,
            plan: ParallelPlan | None = None, compile_backend: str | None = None) -> nn.Module:
    """A model FSDP2 does not shard, as parallelize leaves one: its blocks checkpointed, compiled where
    `compile_backend` names a backend (model.compile), then its forward under autocast. For a shrunk
    group's stand-in (trainer/admission.py, trainer/replan_reform.py) and one-rank groups."""
    model = checkpoint_layers(model, checkpointing, plan)
    if compile_backend:
        model = compile_layers(model, compile_backend, plan)
    return autocast_forward(model, mixed_precision, device)
