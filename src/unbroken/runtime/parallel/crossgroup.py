"""Which cross-replica group a rank reduces in: gloo (collectives.EpochGroup) or NCCL (nccl.NcclEpochGroup).

Owns: the one place `parallel.cross_backend` ("auto", "nccl", "gloo") and the rank's device become a
class (`choose`, `epoch_group`); the check that refuses NCCL where no CUDA is (`check`); what a rank's
events say about its device (`describe`). Does not own: the groups themselves, the device binding
(device.py), or the intra-group backend (device.backend).

auto is NCCL when the rank computes on CUDA and gloo otherwise: on a GPU gloo stages every CUDA tensor
through host memory and its TCP ring, per step, which NCCL does not. gloo stays the choice where NCCL
cannot run (a CPU rank) and for the step protocol's CPU tensors.
"""
from __future__ import annotations

import torch
from torch.distributed import Store

from unbroken.config import ConfigError
from unbroken.runtime.parallel.collectives import EpochGroup
from unbroken.runtime.parallel.nccl import NcclEpochGroup

CrossGroup = EpochGroup | NcclEpochGroup


def choose(setting: str, device: torch.device | str) -> str:
    """"nccl" or "gloo" for a rank computing on `device` under `parallel.cross_backend=setting`. Raises
    ConfigError (one line) for "nccl" on a device that is not CUDA."""
    kind = torch.device(device).type
    if setting == "auto":
        return "nccl" if kind == "cuda" else "gloo"
    if setting == "nccl" and kind != "cuda":
        raise ConfigError(f"parallel.cross_backend='nccl': this rank computes on {kind}, and NCCL reduces CUDA "
                          f"tensors only; use --parallel.cross_backend=gloo or auto, or --parallel.device=cuda")
    return setting


def check(setting: str, device_setting: str) -> None:
    """The config-time check, before any process starts: "nccl" needs `parallel.device` to resolve to
    CUDA in this process (torch.cuda.is_available()). Raises ConfigError (one line)."""
    if setting != "nccl":
        return
    if device_setting == "cpu" or not torch.cuda.is_available():
        why = "parallel.device='cpu'" if device_setting == "cpu" else \
            "this host sees no CUDA device (torch.cuda.is_available() is False)"
        raise ConfigError(f"parallel.cross_backend='nccl' needs CUDA ranks, and {why}; use "
                          f"--parallel.cross_backend=auto or gloo")


def epoch_group(setting: str, device: torch.device, store: Store, epoch: int, members: tuple[int, ...], me: int,
                timeout_s: float, shard: int = 0) -> CrossGroup:
    """The cross-replica group of `members` in `epoch` for shard index `shard`, of the class `choose`
    picks; its formation starts now, off the caller's thread. Call once per (epoch, members, shard)."""
    if choose(setting, device) == "nccl":
        return NcclEpochGroup(store, epoch, members, me, timeout_s, shard=shard, device=torch.device(device))
    return EpochGroup(store, epoch, members, me, timeout_s, shard=shard)


def describe(device: torch.device | str, setting: str) -> dict:
    """The device fields of a rank's `worker_start` event: `device` ("cpu" or "cuda:N"), `device_name`,
    `nccl` (torch's NCCL version where the rank is on CUDA, else None) and `cross_backend` (`choose`'s)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    nccl = None
    if on_cuda:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    where = f"cuda:{device.index or 0}" if on_cuda else device.type
    return dict(device=where, device_name=name, nccl=nccl, cross_backend=choose(setting, device))
