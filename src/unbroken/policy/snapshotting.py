"""Snapshot and restart policy: who snapshots which share, and where a restart loads from.

Owns: the share each live replica writes (every data-parallel replica holds the same state, so each
snapshots only its 1/R share, REFT-style; the share of a replica that died is adopted by a survivor so
later snapshots stay whole), the choice of restore source after a failure, and the Young/Daly
checkpoint interval. Does not own: copying bytes, parity, agents or DCP (runtime/), clocks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def share_owner(share: int, members: Sequence[int]) -> int:
    """The live replica that snapshots `share` (a replica id of the full world): itself while alive,
    else a survivor chosen round-robin, so adopted shares spread evenly. Raises ValueError if no member."""
    if not members:
        raise ValueError("no live replica to own a snapshot share")
    alive = sorted(members)
    return share if share in alive else alive[share % len(alive)]


def shares_of(replica: int, members: Sequence[int], world: int) -> tuple[int, ...]:
    """Every share of the `world`-replica layout that `replica` writes, given the live `members`."""
    return tuple(s for s in range(world) if share_owner(s, members) == replica)


def restore_source(mode: str, memory_ok: bool, disk_ok: bool) -> str:
    """Where a whole-job restart loads state from: "memory" (the agents' snapshots), "disk" (the
    latest DCP checkpoint) or "scratch" (nothing survives: step 0). `mode` is the run's recovery mode;
    restart-disk never uses memory, the baseline it models has none."""
    if mode != "restart-disk" and memory_ok:
        return "memory"
    return "disk" if disk_ok else "scratch"


def needs_restart(mode: str, lost: int, live: int) -> bool:
    """After `lost` replicas failed with `live` still running: live recovery restarts only when nobody
    is left to hold the state; the restart modes restart the whole job on any failure."""
    if lost <= 0:
        return False
    return live == 0 if mode == "live" else True


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Optimal seconds between checkpoints, sqrt(2 * C * MTBF) (Young 1974; Daly 2006 first order).
    Raises ValueError for non-positive inputs."""
    if checkpoint_cost_s <= 0 or mtbf_s <= 0:
        raise ValueError("checkpoint cost and MTBF must be positive")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)
