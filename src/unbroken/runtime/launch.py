"""The local launcher: coordinator first, then one worker process per replica group, then watch them.

Owns: the run directory (config.json, events.jsonl, logs/), starting the coordinator and the workers with
the environment a torchrun job per replica group would give them, reporting each worker's exit to the
store (as a torchrun agent sees its workers end), live progress, the run's end and summary.json, and
killing everything it started, whatever happens. Does not own: liveness verdicts (coordinator), training.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.progress import LiveView
from unbroken.report import summarize
from unbroken.runtime.coordination import connect

DEFAULT_WORKER = [sys.executable, "-m", "unbroken.runtime.worker"]


@dataclass(frozen=True)
class RunResult:
    ok: bool
    run_dir: Path
    steps_committed: int
    last_committed_step: int
    error: str | None
    summary: dict


def launch(cfg: Config, worker_cmd: list[str] | None = None, title: str = "train") -> RunResult:
    """Run `cfg` to the end. Blocks; returns a RunResult (never raises for failures of the run itself)."""
    run_dir = Path(cfg.run.out)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in ("events.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    log = EventLog(run_dir / "events.jsonl", who="launcher")
    t0 = time.time()
    log.emit("run_start", replicas=cfg.run.replicas, steps=cfg.run.steps, microbatches=cfg.run.microbatches,
             exact=cfg.run.exact, seed=cfg.run.seed, faults=cfg.run.faults)
    procs: list[subprocess.Popen] = []
    view = LiveView(cfg.run.steps, title, enabled=cfg.run.progress)
    try:
        coordinator, address = _start_coordinator(cfg, run_dir)
        procs.append(coordinator)
        workers = {r: _start_worker(cfg, worker_cmd or DEFAULT_WORKER, run_dir, address, r)
                   for r in range(cfg.run.replicas)}
        procs.extend(workers.values())
        store = connect(address)
        error = _watch(cfg, store, workers, log, view, run_dir, t0)
        store.set("shutdown", "1")
        coordinator.wait(timeout=10)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        view.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = summarize(run_dir / "events.jsonl", cfg)
    ok = error is None and summary["steps_committed"] == cfg.run.steps
    if error is None and not ok:
        error = f"only {summary['steps_committed']} of {cfg.run.steps} steps committed"
    log.emit("run_end", ok=ok, steps_committed=summary["steps_committed"], seconds=round(time.time() - t0, 3),
             error=error)
    summary = summarize(run_dir / "events.jsonl", cfg)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.close()
    return RunResult(ok, run_dir, summary["steps_committed"], summary["last_committed_step"], error, summary)


def _start_coordinator(cfg: Config, run_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start the coordinator on a port chosen here, so workers start (and import torch) meanwhile;
    their store clients retry until the server is up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "unbroken.runtime.coordinator", "--replicas", str(cfg.run.replicas),
           "--run-dir", str(run_dir), "--port", str(port), "--heartbeat-timeout", str(cfg.coord.heartbeat_timeout),
           "--progress-timeout", str(cfg.coord.progress_timeout),
           "--startup-timeout", str(cfg.coord.startup_timeout), "--quotas", cfg.run.quotas]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(run_dir / "logs" / "coordinator.log", "wb"))
    return p, f"127.0.0.1:{port}"


def _start_worker(cfg: Config, cmd: list[str], run_dir: Path, address: str, r: int) -> subprocess.Popen:
    env = {**os.environ, "UNBROKEN_STORE": address, "UNBROKEN_REPLICA": str(r), "UNBROKEN_RUN_DIR": str(run_dir),
           # the intra-group world of a replica group (one rank in data parallelism), as torchrun sets it
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    out = open(run_dir / "logs" / f"replica{r}.log", "wb")
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    (run_dir / "logs" / f"replica{r}.pid").write_text(str(p.pid))  # for operators (and tests) to kill -9
    return p


def _watch(cfg: Config, store, workers: dict[int, subprocess.Popen], log: EventLog, view: LiveView,
           run_dir: Path, t0: float) -> str | None:
    """Report exits to the store, feed the live view, stop on success, total loss, or the run timeout."""
    reported: set[int] = set()
    offset = 0
    events = run_dir / "events.jsonl"
    while True:
        for r, p in workers.items():
            code = p.poll()
            if code is not None and r not in reported:
                reported.add(r)
                log.emit("exit", replica=r, code=code)
                if code != 0:  # a clean exit is a finished replica, not a failure
                    store.set(f"exit/{r}", str(code))
                    store.add("nexits", 1)
        offset = _tail(events, offset, view)
        if store.check(["failed"]):
            failed = json.loads(store.get("failed"))
            return f"{failed['reason']}; last committed step: {failed['last_committed_step']}"
        if all(r in reported or store.check([f"dead/{r}"]) for r in workers):
            if any(store.check([f"finished/{r}"]) for r in workers):
                return None  # the rest are zombies (declared dead, still stopped): killed on the way out
            last = int(store.get("last_commit")) if store.check(["last_commit"]) else -1
            return f"every replica was lost; last committed step: {last}"
        if time.time() - t0 > cfg.coord.run_timeout:
            for p in workers.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
            return f"run timed out after {cfg.coord.run_timeout:.0f} s"
        time.sleep(0.02)


def _tail(path: Path, offset: int, view: LiveView) -> int:
    if not view.enabled:
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    records = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
    view.feed(records)
    return offset + end
