"""In-memory snapshots held by a per-node agent process, sharded across replicas and erasure coded
across nodes (REFT-style). Public API: SnapshotClient (trainer), start_agent / stop_agent /
request_rebuild / remove_run (launcher), the StateLoadError family. See client.py and control.py
for the calling contracts."""

from .client import Restored, SnapshotClient
from .control import AgentSpec, Topology, remove_run, request_rebuild, start_agent, stop_agent
from .errors import (ChecksumMismatch, ForeignSnapshot, SnapshotNotFound, StateLoadError,
                     Unrecoverable, WorldSizeMismatch)

__all__ = ["AgentSpec", "ChecksumMismatch", "ForeignSnapshot", "Restored", "SnapshotClient",
           "SnapshotNotFound", "StateLoadError", "Topology", "Unrecoverable", "WorldSizeMismatch",
           "remove_run", "request_rebuild", "start_agent", "stop_agent"]
