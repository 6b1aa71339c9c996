"""Resuming a run that ended early: what `unbroken resume RUN_DIR` continues from, checked first.

Owns: reading a run directory back into what the launcher needs to continue it (the config it ran with,
its run id, the next restart generation, the faults that already fired) and refusing, with one line, a
directory that is not a run or a run that already finished. Does not own: starting anything (launch.py),
choosing memory or disk (policy/snapshotting.py), or loading state (persist/persistence.py).

A resumed run is one more whole-job restart of the same run, as the launcher does after losing every
trainer, except that the coordinator and the agents are new processes: the log gets a `restart` record
(`resumed: true`) and the next generation's records after it, so `compare` and `audit` read it as they
read any restart. The run id is kept: the agents adopt the slot files (`snapshot.shm_dir/node{n}/RUN_ID`)
a lost coordinator left in place, and DCP checkpoints are found under the same id.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from unbroken.runtime.launcher.processes import start_time

from unbroken.config import Config, ConfigError, build, canonical
from unbroken.events import CorruptLog, read_log
from unbroken.faultspec import Fault

# sections whose keys change the trajectory, the layout or how processes start: a resumed run runs as the run
# it continues
_FIXED = ("run.", "faults.", "launch.", "model.", "data.", "eval.", "optim.", "snapshot.", "checkpoint.")
_MAY_CHANGE = ("launch.progress", "run.threads")


@dataclass(frozen=True)
class Resumption:
    run_id: str
    generation: int  # the restart generation the resumed trainers run in (coordination keys under g{N}/)
    last_step: int  # the last step with a record in the log (-1: none)
    fired: tuple[tuple[str, int | None, int | None, int | None, str | None], ...]  # (kind, replica, node, step, phase)
    reason: str  # why the run ended, as its last run_end says (or that it has none: the launcher died)


def read_run(run_dir: Path, overrides: dict[str, str]) -> tuple[Config, Resumption]:
    """The config and resume point of the run in `run_dir`, with `overrides` (only coord.*, metrics.* and
    the keys in _MAY_CHANGE) applied. Raises ConfigError, one line, for a directory that is not a run, a
    run that finished, a run still running, or an override that would change the trajectory."""
    for key in overrides:
        if canonical(key).startswith(_FIXED) and canonical(key) not in _MAY_CHANGE:
            raise ConfigError(f"--{key}: a resumed run keeps the settings it ran with (only coord.*, metrics.*, "
                              f"{', '.join(_MAY_CHANGE)} may change)")
    events, config = run_dir / "events.jsonl", run_dir / "config.json"
    if not events.is_file() or not config.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no events.jsonl and config.json)")
    try:
        log = read_log(run_dir)
        tree = json.loads(config.read_text())
    except (CorruptLog, ValueError) as e:
        raise ConfigError(f"{str(run_dir)!r}: cannot be resumed: {e}") from None
    cfg = build(tree, overrides)
    records = log.records
    start = next((r for r in records if r["event"] == "run_start"), None)
    if start is None or not start.get("run_id"):
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (its events.jsonl has no run_start)")
    ends = [r for r in records if r["event"] == "run_end"]
    if ends and ends[-1].get("ok"):
        raise ConfigError(f"{str(run_dir)!r} already finished: all {start['steps']} steps committed")
    if not ends and _still_running(run_dir):
        raise ConfigError(f"{str(run_dir)!r} is still running (its coordinator process is alive)")
    steps = [r["step"] for r in records if r["event"] == "step"]
    fired = tuple((r.get("kind"), r.get("replica"), r.get("node"), r.get("step"), r.get("phase"))
                  for r in records if r["event"] == "fault")
    reason = ends[-1].get("error") or "ended early" if ends else "the launcher ended without a run_end record"
    generation = sum(r["event"] == "restart" for r in records) + 1
    return cfg, Resumption(start["run_id"], generation, max(steps, default=-1), fired, reason)


def already_fired(faults: tuple[Fault, ...], fired) -> set[int]:
    """Indices into `faults` (the parsed spec, in order) of faults whose `fault` record is in the log:
    they fired before the resume and must not fire again in the steps redone after it."""
    done = set()
    for n, f in enumerate(faults):
        for kind, replica, node, step, phase in fired:
            if f.kind == kind and f.step == step and f.replica in (None, replica) and f.node in (None, node) \
                    and (f.phase is None or phase is None or f.phase == phase):
                done.add(n)
    return done


def _still_running(run_dir: Path) -> bool:
    """Whether the run's coordinator process is alive: its pid file names a live process that started
    when the launcher recorded (a forked coordinator's command line is the fork server's), or, for a run
    directory without that record, whose command line names the run."""
    logs = run_dir / "logs"
    try:
        pid = int((logs / "coordinator.pid").read_text())
        started = (logs / "coordinator.started").read_text().strip() if (logs / "coordinator.started").exists() \
            else None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return False
    if started is not None:
        return started == str(start_time(pid))
    return str(run_dir) in cmdline and os.path.exists(f"/proc/{pid}")
