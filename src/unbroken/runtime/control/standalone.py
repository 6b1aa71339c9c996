"""`unbroken coordinator`: the coordinator as a command of its own, for workers that torchrun starts.

Owns: what the local launcher does for the coordinator when there is no launcher: binding the store on
the address asked for (loopback unless told otherwise), publishing the run's config, directory and id in
it for the workers, the run directory (config.json, events.jsonl, summary.json), the lines a user runs
next (one torchrun per replica group), and ending the run when every group finished or was lost. Does
not own: the coordinator's loop (coordinator.py) or starting workers (the user's torchrun, or Slurm).
"""
from __future__ import annotations

import datetime
import secrets
import shlex
import socket
import time
from pathlib import Path

from torch.distributed import PrefixStore, TCPStore

from unbroken.config import Config, ConfigError
from unbroken.events import EventLog
from unbroken.report import finish_run
from unbroken.runtime.control import keys
from unbroken.runtime.control.coordinator import Coordinator, serve
from unbroken.runtime.control.metrics import Exporter, preflight
from unbroken.runtime.control.store import last_committed


def torchrun_line(address: str, group: int, group_size: int, max_restarts: int = 0) -> str:
    """The command that starts replica group `group` on its host (one torchrun job per group)."""
    return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={group_size}",
                       f"--max-restarts={max_restarts}", "-m", "unbroken.runtime.worker",
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


def run(cfg: Config, host: str = "127.0.0.1", port: int = 0, say=print) -> int:
    """Serve `cfg`'s run until it ends; returns 0 when every step committed, 1 otherwise. Raises
    ConfigError before anything is written when the address cannot be bound or the run directory made."""
    if cfg.coord.store:  # workers started by torchrun reach the run through this process's TCPStore
        raise ConfigError(f"coord.store={cfg.coord.store!r}: `unbroken coordinator` serves its own TCPStore; "
                          "an etcd store works under `unbroken train` for now")
    out = Path(cfg.run.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".unbroken-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: {e.strerror or e}") from None
    m = cfg.metrics
    preflight(m.port, m.host, m.tensorboard)  # a bad metrics option fails before anything is touched
    store = bind(host, port)
    address = f"{host}:{store.port}"
    for stale in ("events.jsonl", "summary.json"):
        (out / stale).unlink(missing_ok=True)
    (out / "config.json").write_text(cfg.to_json())
    run_id = f"run-{secrets.token_hex(4)}"
    store.set(keys.config(), cfg.to_json())
    store.set(keys.run_dir(), str(out.resolve()))
    store.set(keys.run_id(), run_id)
    log = EventLog(out / "events.jsonl", who="coordinator")
    t0 = time.time()
    r, c = cfg.run, cfg.coord
    log.emit("run_start", replicas=r.replicas, steps=r.steps, microbatches=r.microbatches, exact=r.exact,
             seed=r.seed, faults=r.faults, recovery=r.recovery, run_id=run_id, coordinator=address,
             group_size=cfg.parallel.group_size, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    say(f"unbroken coordinator: serving {address} ({r.replicas} replica groups, {r.steps} steps, run dir {out})")
    say("start one torchrun job per replica group (on its host):")
    for g in range(r.replicas):
        say("  " + torchrun_line(address, g, cfg.topology().group_size))
    code = serve(store, address, r.replicas, log,
                 lambda s: Coordinator(s, r.replicas, log, c.heartbeat_timeout, c.progress_timeout,
                                       c.startup_timeout, follow_speed=r.quotas == "speed",
                                       beat_every=c.heartbeat_interval, group_size=cfg.parallel.group_size),
                 c.heartbeat_interval, until_finished=True,
                 exporter=Exporter(out, store, m.port, m.host, m.tensorboard,
                                   str(cfg.checkpoint.dir or out / "checkpoints") if cfg.checkpoint.every else ""))
    time.sleep(1.0)  # the last members' record writes and final beats reach the store before it closes
    # the store's word, as in the `run_failed` record: it also counts a commit whose record's writer died
    last = last_committed(PrefixStore(keys.generation_prefix(0), store))
    error = None if code == 0 else f"every replica group was lost; last committed step: {last}"
    ok, summary, error = finish_run(out, cfg, log, t0, error)
    say(f"run dir: {out}  steps committed: {summary['steps_committed']}/{r.steps}  "
        f"final loss: {summary['final_loss']}  groups lost: {summary['members_lost']}")
    if not ok:
        say(f"unbroken: error: {error}")
    return 0 if ok else 1
