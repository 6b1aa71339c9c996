"""Typed errors for loading saved state (in-memory snapshots and DCP checkpoints).

Owns the exception hierarchy and nothing else. Every error carries a one-line message that names
what was expected and what was found, so a launcher can log it and fall back to the next source
(snapshot -> persistent checkpoint -> fresh start). Raising one of these means nothing was loaded.
"""

from __future__ import annotations


class StateLoadError(RuntimeError):
    """Base: a snapshot or checkpoint could not be used; nothing was loaded."""

    def __init__(self, message: str) -> None:
        # One line by contract: callers print these in a single log line.
        super().__init__(" ".join(message.split()))


class SnapshotNotFound(StateLoadError):
    """No committed snapshot (missing shm directory, no slots, or no step held by every rank)."""


class ForeignSnapshot(StateLoadError):
    """The files belong to another run (run id or magic differs)."""


class WorldSizeMismatch(StateLoadError):
    """The saved state was written by a different number of ranks than the caller has."""


class ChecksumMismatch(StateLoadError):
    """Bytes differ from the checksum recorded at snapshot time (torn, corrupted or badly rebuilt)."""


class Unrecoverable(StateLoadError):
    """More was lost than the erasure code covers, or the peers needed to rebuild are gone."""


class CheckpointNotFound(StateLoadError):
    """No complete persistent checkpoint in the directory (or the directory is missing)."""


class ForeignCheckpoint(StateLoadError):
    """The checkpoint directory belongs to another run."""
