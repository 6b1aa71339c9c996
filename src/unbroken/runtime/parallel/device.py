"""The device a rank computes on, and the backend of its replica group's process group.

Owns: resolving `parallel.device` ("auto", "cpu", "cuda") in a trainer process; binding the process to its
GPU before any CUDA work or process group exists (`bind`); the intra-group backend (`backend`); the NCCL
error-handling settings a fault-tolerant group needs (`nccl_environment`). Does not own: the cross-group
fault-tolerant all-reduce (collectives.py), which stays on gloo on a GPU too (gloo reduces CUDA tensors by
staging them through host memory): an NCCL communicator whose peer died must be aborted, and a gloo group
just times out and is dropped, which is what the epoch protocol does today.

Which GPU, modulo the GPUs this process sees: on a cluster LOCAL_RANK (torchrun's index of the rank on
its node; each torchrun job sees its own GPUs through CUDA_VISIBLE_DEVICES); under the local launcher, which
puts every group on one host, UNBROKEN_DEVICE_BASE (r x group_size for group r, as `run.pin_cores` lays
out cores) plus RANK, the rank's index in its group (with one torchrun agent per rank, every rank's
LOCAL_RANK is 0).

Not run on a GPU yet (no GPU machine has been lent to this project): the CPU path of every function here is
the one the test suite runs.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

from unbroken.config import ConfigError


def resolve(name: str) -> torch.device:
    """The device `parallel.device` names, for this process: "auto" is CUDA when it sees a GPU. Call once,
    at a trainer's start. Raises ConfigError (one line) for "cuda" where no GPU is visible."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device='cuda': this process sees no CUDA device (torch.cuda.is_available() "
                          "is False)")
    return torch.device(name)


def bind(device: torch.device, env: Mapping[str, str]) -> torch.device:
    """Make this process's GPU the current CUDA device (a no-op on CPU) and return it with its index. Call
    once, before the group's process group, the model or any CUDA tensor exists: NCCL takes the current
    device for its communicator, and two ranks on one GPU are refused ("Duplicate GPU detected")."""
    if device.type != "cuda":
        return device
    index = gpu_index(env, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_index(env: Mapping[str, str], gpus: int) -> int:
    """The GPU (0 .. gpus-1) of the rank whose environment is `env` (the module docstring says which)."""
    if "UNBROKEN_DEVICE_BASE" in env:  # the local launcher: every group on this host
        return (int(env["UNBROKEN_DEVICE_BASE"]) + int(env.get("RANK", "0"))) % gpus
    return int(env.get("LOCAL_RANK", "0")) % gpus


def backend(device: torch.device) -> str:
    """The intra-group process group's backend: gloo on CPU; on a GPU NCCL for CUDA tensors (the model's
    collectives: FSDP2, TP, the pipeline) and gloo for the CPU tensors of the step protocol (object
    gathers, a retry's flags, the restore's agreement), one group with both."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def nccl_environment(environ: MutableMapping[str, str]) -> None:
    """NCCL's settings for a group whose peer may die, unless the user set them: a collective that fails
    or times out raises in the waiting rank (blocking wait) and NCCL cleans up its communicator
    (async error handling 2), where its default (3) ends the whole process from its watchdog thread, so
    a survivor could neither report its group broken nor go on shrunk. Call before the process group."""
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")

