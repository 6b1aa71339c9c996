"""`unbroken coordinator`: the coordinator as a command of its own, for workers that torchrun starts.

Owns: what the local launcher does for the coordinator when there is no launcher: the run's store
(a TCPStore bound on the address asked for, loopback unless told otherwise; or, with
`--coord.store=etcd://...`, a namespace in etcd that several such coordinators share, one leading),
publishing the run's config, directory and id in it for the workers, the run directory (config.json,
events.jsonl, summary.json), the lines a user runs next (one torchrun per replica group), and ending the
run when every group finished or was lost. Does not own: the coordinator's loop (coordinator.py), the
election (election.py) or starting workers (the user's torchrun, or Slurm).

With etcd, who writes what: every coordinator claims the namespace for its config (one compare-and-set:
a coordinator with another config is refused before it writes anything), then waits to lead. Only the
leader writes to the run directory: the first leader clears it and writes config.json and `run_start`;
each leader writes its `coordinator_leads` record, and the one leading when the run ends writes
`run_end` and summary.json after it has marked the run over in etcd (`shutdown`, a fenced write: a
deposed leader ends there instead). A standby that comes to lead over an ended run writes the summary
only if its predecessor died before it, and exits with the run's outcome.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import shlex
import socket
import time
from pathlib import Path

from torch.distributed import PrefixStore, Store, TCPStore

from unbroken.config import Config, ConfigError
from unbroken.events import EventLog, read_events
from unbroken.observe.runs import finish_run
from unbroken.runtime.store import keys
from unbroken.runtime.coordinator.coordinator import Coordinator, serve
from unbroken.runtime.coordinator.metrics import Exporter, preflight
from unbroken.runtime.coordinator.replan import group_shape
from unbroken.runtime.store.client import connect, last_committed, read
from unbroken.runtime.store.client import preflight as store_preflight


def torchrun_line(address: str, group: int, group_size: int, max_restarts: int = 0) -> str:
    """The command that starts replica group `group` on its host (one torchrun job per group)."""
    return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={group_size}",
                       f"--max-restarts={max_restarts}", "-m", "unbroken.runtime.trainer",
                       "--coordinator", address, "--group", str(group)])


def bind(host: str, port: int) -> TCPStore:
    """The store's server on host:port (0: any free port). Raises ConfigError, one line, when the port is
    in use or the host is not an address of this machine."""
    with socket.socket() as s:  # TCPStore's own error for a taken port is a C++ trace, not a reason
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror.lower() if e.strerror else e}") from None
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60),
                    use_libuv=True)


def run(cfg: Config, host: str | None = None, port: int | None = None, say=print) -> int:
    """Serve `cfg`'s run until it ends; returns 0 when every step committed, 1 otherwise. `host`/`port`:
    where to bind the TCPStore (default 127.0.0.1:29400; 0: any free port); with `cfg.coord.store` (etcd)
    nothing is bound and giving either is bad input. Raises ConfigError, one line, before anything is
    written, when the address cannot be bound, the etcd store does not answer or holds another run, or
    the run directory cannot be made."""
    if cfg.coord.store:
        if host is not None or port is not None:
            flag = "--host" if host is not None else "--port"
            raise ConfigError(f"{flag}: with coord.store={cfg.coord.store!r} the coordinator binds nothing "
                              "(the run's state is in etcd; workers take --coordinator with that URL)")
        return _run_in_etcd(cfg, say)
    out = _run_dir(cfg)
    store = bind(host or "127.0.0.1", 29400 if port is None else port)
    address = f"{host or '127.0.0.1'}:{store.port}"
    log, run_id = _publish(cfg, store, out)
    t0 = time.time()
    _run_start(cfg, log, run_id, address)
    say(f"unbroken coordinator: serving {address} ({cfg.run.replicas} replica groups, {cfg.run.steps} steps, "
        f"run dir {out})")
    _say_lines(cfg, address, say)
    code = _serve(cfg, store, address, log, out)
    error = _verdict(store, code)
    return _finish(cfg, out, log, t0, error, say)


def _run_in_etcd(cfg: Config, say) -> int:
    """One of the run's coordinators in etcd: claim the namespace, wait to lead, lead until the run ends."""
    url, mine = cfg.coord.store, cfg.to_json()
    store_preflight(url, config=mine)  # a member answers; the namespace is empty or holds this run, running
    out = _run_dir(cfg)
    store = connect(url)
    if store.compare_set(keys.config(), "", mine) != mine.encode():  # another run claimed it since the check
        store_preflight(url, config=mine)  # ... and says whose it is, in the same words
        raise ConfigError(f"coord.store={url!r}: another run took the namespace")
    say(f"unbroken coordinator: run in {url} ({cfg.run.replicas} replica groups, {cfg.run.steps} steps, "
        f"run dir {out}); the coordinator holding its lease leads, others stand by")
    _say_lines(cfg, url, say)
    from unbroken.runtime.coordinator.election import lead

    def deposed() -> None:  # a write found another coordinator leading: stop before doing anything else
        EventLog(out / "events.jsonl", who="coordinator").emit("coordinator_deposed", pid=os.getpid())
        os._exit(3)
    leadership, waited = lead(store, cfg.coord.lease_ttl, deposed)
    ended = read(store, keys.shutdown())
    if ended is not None:  # the run ended under another coordinator (it resigned, or died at the end)
        code = _ended(cfg, out, json.loads(ended)["error"])
        leadership.resign()
        say(f"unbroken coordinator: the run ended under another coordinator (exit {code})")
        return code
    first = read(store, keys.run_id()) is None  # written last by the first leader: the run is set up
    if first:
        log, run_id = _publish(cfg, store, out, start=lambda log, rid: _run_start(cfg, log, rid, url))
        t0 = time.time()
    else:
        log, run_id = EventLog(out / "events.jsonl", who="coordinator"), read(store, keys.run_id()).decode()
        t0 = _started_at(out)
    log.emit("coordinator_leads", pid=os.getpid(), host=socket.gethostname(), waited=round(waited, 3),
             takeover=not first, previous=leadership.previous)
    took = "" if first else f" (took over from {leadership.previous})" if leadership.previous else " (took over)"
    say(f"unbroken coordinator: leading run {run_id}{took}")
    code = _serve(cfg, store, url, log, out)
    error = _verdict(store, code)
    store.set(keys.shutdown(), json.dumps({"error": error}))  # fenced: a deposed leader ends here, unheard
    try:
        return _finish(cfg, out, log, t0, error, say)
    finally:
        leadership.resign()  # a standby takes over at once, finds the run over and exits with its outcome


def _run_dir(cfg: Config) -> Path:
    out = Path(cfg.launch.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".unbroken-write-test-{os.getpid()}"  # coordinators of one run may probe at once
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: {e.strerror or e}") from None
    m = cfg.metrics
    preflight(m.port, m.host, m.tensorboard, m.wandb)  # a bad metrics option fails before anything is touched
    return out


def _publish(cfg: Config, store: Store, out: Path, start=None) -> tuple[EventLog, str]:
    """Start the run directory afresh and publish the run in the store for the workers: config, run
    directory, then its id (last: a worker that finds the id finds the rest). `start(log, run_id)`
    writes the first records before the id is out. Returns the coordinator's log and the run id."""
    for stale in ("events.jsonl", "summary.json"):
        (out / stale).unlink(missing_ok=True)
    (out / "config.json").write_text(cfg.to_json())
    run_id = f"run-{secrets.token_hex(4)}"
    log = EventLog(out / "events.jsonl", who="coordinator")
    if start is not None:
        start(log, run_id)
    store.set(keys.config(), cfg.to_json())
    store.set(keys.run_dir(), str(out.resolve()))
    store.set(keys.run_id(), run_id)
    return log, run_id


def _run_start(cfg: Config, log: EventLog, run_id: str, address: str) -> None:
    r = cfg.run
    log.emit("run_start", replicas=r.replicas, steps=r.steps, microbatches=r.microbatches, exact=r.exact,
             seed=r.seed, faults=cfg.faults.spec, recovery=r.recovery, run_id=run_id, coordinator=address,
             group_size=cfg.parallel.group_size, pp=cfg.parallel.pp, tp=cfg.parallel.tp)


def _say_lines(cfg: Config, address: str, say) -> None:
    say("start one torchrun job per replica group (on its host):")
    for g in range(cfg.run.replicas):
        say("  " + torchrun_line(address, g, cfg.topology().group_size))


def _serve(cfg: Config, store: Store, address: str, log: EventLog, out: Path) -> int:
    r, c, m = cfg.run, cfg.coord, cfg.metrics
    return serve(store, address, r.replicas, log,
                 lambda s: Coordinator(s, r.replicas, log, c.heartbeat_timeout, c.progress_timeout,
                                       c.startup_timeout, quotas=r.quotas,
                                       beat_every=c.heartbeat_interval, group_size=cfg.parallel.group_size,
                                       shape=group_shape(cfg), detector=cfg.detector),
                 c.heartbeat_interval, until_finished=True,
                 exporter=Exporter(out, store, m.port, m.host, m.tensorboard,
                                   str(cfg.checkpoint.dir or out / "checkpoints") if cfg.checkpoint.every else "",
                                   wandb=m.wandb))


def _verdict(store: Store, code: int) -> str | None:
    time.sleep(1.0)  # the last members' record writes and final beats reach the store before it closes
    # the store's word, as in the `run_failed` record: it also counts a commit whose record's writer died
    last = last_committed(PrefixStore(keys.generation_prefix(0), store))
    return None if code == 0 else f"every replica group was lost; last committed step: {last}"


def _finish(cfg: Config, out: Path, log: EventLog, t0: float, error: str | None, say) -> int:
    ok, summary, error = finish_run(out, cfg, log, t0, error)
    say(f"run dir: {out}  steps committed: {summary['steps_committed']}/{cfg.run.steps}  "
        f"final loss: {summary['final_loss']}  groups lost: {summary['members_lost']}")
    if not ok:
        say(f"unbroken: error: {error}")
    return 0 if ok else 1


def _ended(cfg: Config, out: Path, error: str | None) -> int:
    """The exit code of a run another coordinator ended; its summary, if that one died before writing it."""
    if not (out / "summary.json").exists():
        finish_run(out, cfg, EventLog(out / "events.jsonl", who="coordinator"), _started_at(out), error)
    return 0 if json.loads((out / "summary.json").read_text()).get("ok") else 1


def _started_at(out: Path) -> float:
    """When the run started (its `run_start` record), for a leader that did not start it."""
    return next((e["t"] for e in read_events(out / "events.jsonl") if e["event"] == "run_start"), time.time())
