"""The words of a dead verdict, which members write (`leave`) and the coordinator reads and writes back.

Owns: the reason vocabulary that crosses the store between the trainer and the coordinator processes: a
rank evicted as slow, a survivor's report that its group's process group broke, and which rank a verdict
names. Does not own: the keys these words are stored under (keys.py) or who writes them (trainer/
membership.py, coordinator/).
"""
from __future__ import annotations

EVICTED = "evicted, slow"  # a dead verdict's words for a rank its group shrinks around (coordinator/replan.py)


def evicted(reason: str, rank: int) -> bool:
    """Whether a fence's reason (a dead verdict "rank J: evicted, slow ...", maybe inside "declared dead
    (...)") evicts `rank` as slow rather than finding it lost: its process should not be restarted on the
    same device (parallelize.release_agent)."""
    return f"rank {rank}: {EVICTED}" in reason


# What a survivor that found its group's process group broken reports (`leave`) under
# parallel.on_rank_loss=replan: it does not know which peer died, but knows a rank did, so the others that
# read the verdict are survivors too and claim (lost_rank: -1), where an exit code would fence them before
# a TP team they are in could re-form.
BROKE = "rank ?: its replica group's process group broke under a survivor (a peer rank died)"


def lost_rank(reason: str) -> int | None:
    """The rank a dead verdict names ("rank J: ...", as the coordinator words it for groups of several
    ranks), -1 for some rank not known (`BROKE`), or None (the group as a whole: an exit)."""
    head = reason.split(":", 1)[0]
    if head == "rank ?":
        return -1
    return int(head[5:]) if head.startswith("rank ") and head[5:].isdigit() else None
