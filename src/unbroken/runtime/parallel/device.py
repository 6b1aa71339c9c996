"""The device a rank computes on, and the backend of its replica group's process group.

Owns: resolving `parallel.device` ("auto", "cpu", "cuda") in a trainer process; binding the process to its
GPU before any CUDA work or process group exists (`bind`); the intra-group backend (`backend`); the NCCL
error-handling settings a fault-tolerant group needs (`nccl_environment`); the kernels `--exact` needs on a
GPU (`exact_kernels`); refusing a group whose ranks would share a GPU (`check_gpus`), unless each rank has a
host identity of its own for NCCL (`hostid_per_rank`). Does not own: the cross-group fault-tolerant
all-reduce (collectives.py on gloo, nccl.py on NCCL, chosen in crossgroup.py).

Which GPU, modulo the GPUs this process sees: on a cluster LOCAL_RANK (torchrun's index of the rank on
its node; each torchrun job sees its own GPUs through CUDA_VISIBLE_DEVICES); under the local launcher, which
puts every group on one host, UNBROKEN_DEVICE_BASE (r x group_size for group r, as `launch.pin_cores` lays
out cores) plus RANK, the rank's index in its group (with one torchrun agent per rank, every rank's
LOCAL_RANK is 0).

Several NCCL ranks on one GPU (a functional test, never for speed): NCCL refuses two ranks of one
communicator whose host identity and bus id match ("Duplicate GPU detected"), and NCCL_HOSTID overrides
the host identity. torchrun gives all of a job's ranks one environment, so the rank sets its own: with
UNBROKEN_NCCL_HOSTID_PER_RANK=1 each trainer sets NCCL_HOSTID from its (group, rank) before any NCCL
call, and `check_gpus` no longer refuses a group with more ranks than GPUs (torchft's train_ddp.py).

What has run on a GPU is in benchmarks/RESULTS.md (`resolve`, `bind`, `check_gpus` and `exact_kernels`
on one GPU); NCCL inside a group of 2 or more GPUs has not run. The test suite runs the CPU path of every
function here.
"""
from __future__ import annotations

import os
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
    gpus = torch.cuda.device_count()
    # the group's ranks on this host: all of them under the local launcher, torchrun's count on a cluster
    local = env.get("WORLD_SIZE", "1") if "UNBROKEN_DEVICE_BASE" in env else env.get("LOCAL_WORLD_SIZE", "1")
    if not shares_gpus(env):
        check_gpus(int(local), gpus)
    index = gpu_index(env, gpus)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_gpus(group_size: int, gpus: int) -> None:
    """Refuse, as bad input, a replica group with more ranks than the GPUs its host's processes see: its
    ranks would share a GPU, and NCCL refuses two ranks of one communicator on one device ("Duplicate GPU
    detected", at the group's first collective, in every rank). Call where the group's size is known and
    before any process group: the launcher's config check, and each rank's `bind`. Groups may share GPUs
    with each other only across gloo groups or with a host identity per rank (`hostid_per_rank`). Raises
    ConfigError (one line)."""
    if group_size > gpus:
        raise ConfigError(f"parallel.group_size={group_size}: a replica group's ranks need a GPU each under NCCL, "
                          f"and this host sees {gpus} (torch.cuda.device_count()); use --parallel.device=cpu or "
                          f"a group size of at most {gpus} a host")


def preflight(name: str, group_size: int) -> None:
    """The local launcher's check, before it touches anything: every group runs on this host, so a
    `parallel.device` that resolves to CUDA needs a GPU per rank of a group (`check_gpus`). Raises
    ConfigError (one line)."""
    if name != "cpu" and resolve(name).type == "cuda" and not shares_gpus(os.environ):
        check_gpus(group_size, torch.cuda.device_count())


def exact_kernels(device: torch.device) -> None:
    """Make this process's CUDA kernels give the same bits for the same inputs, which `--exact` needs:
    a microbatch redone by another replica must produce the gradient the lost one would have. By
    default they do not: the embedding's backward adds with atomics, so the order of a token row's
    additions varies, and SDPA's memory-efficient and flash backward kernels may too. This turns on
    torch's deterministic algorithms (an op without one raises rather than varies), cuBLAS's fixed
    workspace (CUBLAS_WORKSPACE_CONFIG, read when the first cuBLAS handle is made) and SDPA's math
    backend. Off outside --exact. Call once, after `bind`, before any CUDA work. A no-op on CPU, whose
    kernels here are deterministic already.

    Measured on an H200 (torch 2.11, `benchmarks/gpu_exact.py`): a 4-layer, width-512 GPT's gradient of
    one 16 x 256-token microbatch took 4 distinct digests over 7 passes with the default kernels and 1
    with these, at 1.89x the pass time; `unbroken demo` on CUDA was identical at 24/24 steps. The
    deterministic algorithms alone also gave 1 digest, at 1.58x, but no end-to-end run has used them
    without the math SDPA yet, so the math backend stays until a GPU session shows it is not needed."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    for sdpa in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{sdpa}_sdp")(False)  # the math backend only


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



def shares_gpus(env: Mapping[str, str]) -> bool:
    """Whether this job's ranks may share GPUs under NCCL: UNBROKEN_NCCL_HOSTID_PER_RANK=1 (the module
    docstring)."""
    return env.get("UNBROKEN_NCCL_HOSTID_PER_RANK", "") == "1"


def hostid_per_rank(environ: MutableMapping[str, str], group: int, rank: int) -> str | None:
    """Where `shares_gpus`, set NCCL_HOSTID to a value of this rank's own ("unbroken-g{group}-r{rank}",
    unique in the job) and return it; else None, the environment untouched. Call once per process,
    before any NCCL communicator exists (NCCL reads it at its first initialisation)."""
    if not shares_gpus(environ):
        return None
    environ["NCCL_HOSTID"] = f"unbroken-g{group}-r{rank}"
    return environ["NCCL_HOSTID"]
