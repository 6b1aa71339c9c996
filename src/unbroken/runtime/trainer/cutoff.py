"""A worker cut off from the coordinator: how it leaves (fenced, one line, its event), not by a traceback.

Owns: judging a broken store connection (DistNetworkError) in the trainer's thread (`cut_off`: the store
does not answer a fresh connection within the heartbeat timeout, or answers that this group was declared
dead meanwhile) and the one line such a group leaves with (`say_cut_off`, also the heartbeat's). Does
not own: the heartbeat's own watch of the store (heartbeat.py) nor the exit codes (lifecycle.py).
"""
from __future__ import annotations

import sys

from torch.distributed import PrefixStore

from unbroken.events import EventLog
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect


def say_cut_off(group_id: int, why: str) -> None:
    """The one line a group cut off from the coordinator leaves with (nothing for another verdict)."""
    if why.startswith("cut off"):
        print(f"unbroken: error: group {group_id} {why}; it leaves", file=sys.stderr, flush=True)


def cut_off(where, error: Exception, conn, log: EventLog, group_id: int) -> str | None:
    """Why this group leaves after a broken connection (DistNetworkError) that was the coordinator's
    store's: the store does not answer a fresh connection within the heartbeat timeout (its host gone,
    or this host's link down), or answers that this group was declared dead meanwhile (a partition that
    healed). It leaves fenced, as a member declared dead does, with one line and its event (none where
    the heartbeat thread leaves as fenced already). None where the store answers and the group is a
    member: the error was another's. `where`: the trainer's Placement; `conn`: its Connection."""
    try:
        fresh = PrefixStore(keys.generation_prefix(where.generation),
                            connect(where.address, timeout_s=where.cfg.coord.heartbeat_timeout))
        if not fresh.check([keys.dead(group_id)]):
            return None
        why = f"declared dead while cut off from the coordinator at {where.address}"
    except Exception as e:  # noqa: BLE001 - nothing answers: cut off
        why = f"cut off from the coordinator at {where.address} ({type(error).__name__}: {error}; {e})"
    conn.heartbeat.stop()
    if conn.heartbeat.latch.claim():
        say_cut_off(group_id, why)
        log.emit("fenced", replica=group_id, reason=why[:300], **conn.tag)
    return why
