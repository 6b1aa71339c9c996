"""What `unbroken status` shows, read: a run directory's event log, or a live run from its coordinator's
store (the status the coordinator publishes, and each member's latest heartbeat).

Owns: finding and reading the status of a target (`load`): RUN_DIR, HOST:PORT of a coordinator, or the
etcd store of a run. Does not own: the figures' definitions (observe/view.py) or drawing the screen
(observe/status.py).
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError
from unbroken.events import read_events
from unbroken.observe.view import RunView


def load(target: str) -> dict[str, Any]:
    """The status dict of RUN_DIR (any run, live or finished), of the coordinator at HOST:PORT, or of the
    run whose state lives at etcd://...[/namespace]."""
    path = Path(target)
    if path.is_dir() or path.exists():
        return _from_dir(path)
    if target.startswith("etcd://"):  # a run whose state lives in etcd (--coord.store)
        return _from_store(target)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{target!r} is neither a run directory nor HOST:PORT of a coordinator")
    return _from_store(target)


def _from_dir(path: Path) -> dict[str, Any]:
    if not (path / "events.jsonl").is_file():
        raise ConfigError(f"{str(path)!r} is not a run directory (no events.jsonl)")
    view = RunView(history=False)
    view.feed(read_events(path))  # CorruptLog (a ConfigError) names the file and line that does not parse
    if view.t0 is None:
        raise ConfigError(f"{str(path)!r} is not a run directory (its events.jsonl has no run_start)")
    view.checkpoint_step = _checkpoint_step(path, view.run_id)
    status = view.status(None if view.ended else time.time())
    status["source"] = f"{path} (event log)"
    return status


def _from_store(address: str) -> dict[str, Any]:
    from torch.distributed import PrefixStore

    from unbroken.runtime.store import keys
    from unbroken.runtime.store.client import connect
    host, _, port = address.rpartition(":")
    try:  # a plain probe first: TCPStore's client would retry, and print C++ stack traces, for seconds
        if address.startswith("etcd://"):  # the run's state in etcd: its client fails over by itself
            from unbroken.runtime.store.client import preflight
            preflight(address, run_id=None, exists=True)
        else:
            socket.create_connection((host, int(port)), timeout=3.0).close()
        store = connect(address, timeout_s=5.0)
    except (RuntimeError, OSError, OverflowError, ValueError) as e:
        raise ConfigError(f"cannot reach a coordinator at {address!r} ({e.strerror or e if isinstance(e, OSError) else e})"
                          ) from None
    if not store.check([keys.status()]):
        raise ConfigError(f"{address!r} serves a store with no unbroken status (not a coordinator, or too early)")
    status = json.loads(store.get(keys.status()))
    # the members' own heartbeats, fresher than the event log: where each one is right now
    generation = int(store.get(keys.generation())) if store.check([keys.generation()]) else 0
    members = PrefixStore(keys.generation_prefix(generation), store)  # the generation's keys, as the workers write them
    beats = {}
    for r in status["replicas"]:
        key = keys.heartbeat(r)
        if members.check([key]):
            raw = members.get(key).decode()
            beats[r] = "fenced" if not raw.startswith("{") else _beat(json.loads(raw))
    status["heartbeats"] = beats
    status["source"] = f"coordinator {address} (run dir {status.get('run_dir')})"
    return status


def _beat(hb: dict[str, Any]) -> str:
    return f"step {hb.get('step')} {hb.get('phase')}" + (f" mb {hb['mb']}" if hb.get("phase") == "compute" else "")


def _checkpoint_step(path: Path, run_id: str) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
        ck = cfg.get("checkpoint", {})
        if not ck.get("every"):
            return None
        from unbroken.runtime.coordinator.metrics import latest_checkpoint_step
        return latest_checkpoint_step(ck.get("dir") or str(path / "checkpoints"), run_id)
    except (OSError, ValueError):
        return None
