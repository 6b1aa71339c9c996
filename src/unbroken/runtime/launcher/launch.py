"""The local launcher: coordinator, snapshot agents, one worker process per replica group; then watch.

Owns: the run directory (config.json, events.jsonl, logs/), the launch's phases (`_Launch`: start the
control plane, run generations of workers, shut down, close), whole-job restarts (a new *generation*: fresh
membership under the store prefix g{N}/, every trainer restarted and resumed from the agents' memory or the
latest checkpoint), summary.json, and killing everything it started. Does not own: how processes start
(starting.py), watching a generation to its verdict (generation.py), launcher-side faults (chaos.py),
liveness verdicts (coordinator), training, what a restart loads (persistence.py).
"""
from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from unbroken.runtime.launcher.zygote import forkable_torch

forkable_torch()  # before torch's first import here: the launcher stays one thread, to fork its server
from torch.distributed import DistError, PrefixStore  # noqa: E402

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.faultspec import parse
from unbroken.policy.snapshotting import restore_source
from unbroken.observe.progress import LiveView
from unbroken.observe.runs import finish_run
from unbroken.runtime.launcher.generation import Coordinators, GenerationWatch
from unbroken.runtime.launcher.processes import kill_tree
from unbroken.runtime.launcher.agents import AgentSet
from unbroken.runtime.launcher.chaos import Chaos
from unbroken.runtime.launcher.resume import Resumption, already_fired
from unbroken.runtime.launcher.starting import DEFAULT_WORKER, fork_server, hold_port, start_coordinator, start_worker
from unbroken.runtime.launcher.zygote import Forked
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect
from unbroken.runtime.store.client import preflight as store_preflight
from unbroken.runtime.store.watch import wake
from unbroken.runtime.coordinator.metrics import preflight

@dataclass(frozen=True)
class RunResult:
    ok: bool
    run_dir: Path
    steps_committed: int
    last_committed_step: int
    error: str | None
    summary: dict


def launch(cfg: Config, worker_cmd: list[str] | None = None, title: str = "train",
           resume: Resumption | None = None, reform_refused: str | None = None) -> RunResult:
    """Run `cfg` to the end. Blocks; returns a RunResult (never raises for failures of the run itself).
    With `resume` (resume.read_run of cfg.launch.out), continue that run in its directory instead: its log
    and logs/ are kept and appended to, and the trainers restore from the agents' memory or a checkpoint.
    `reform_refused`: why a group that loses a rank cannot re-form onto fewer ranks (api.check_host), for
    the coordinator's scheduler (replan.GroupShape)."""
    m = cfg.metrics
    preflight(m.port, m.host, m.tensorboard, m.wandb)  # a bad metrics option fails before anything is touched
    store_preflight(cfg.coord.store, resume.run_id if resume else None)  # etcd: answers, holds no other run
    run_dir, run_id, log = _prepare(cfg, resume)
    t0 = time.time()
    run = _Launch(cfg, log, LiveView(cfg.run.steps, title, enabled=cfg.launch.progress), worker_cmd)
    restore_sigterm = _sigterm_interrupts()
    try:
        run.start(run_dir, run_id, t0, resume, reform_refused)
        run.error = run.generations(run_dir, run_id)
        run.shut_down()
    except KeyboardInterrupt:
        run.error = "interrupted"
    except _CoordinatorLost as e:
        run.error, run.lost = str(e), True
    except DistError:
        # A store call after the watch (the shutdown's write, a restart's) that found the coordinator gone
        # ends the run as the watch's "lost" does: the watch sees the coordinator's end only once it is
        # reaped, so a coordinator SIGKILLed as its trainers saw the store go can still read as "failed"
        # there, and without this the run would end with no run_end and no memory kept for resume.
        watch = run.watch
        if watch is None or watch.coordinator is None or not watch.coordinator_gone(wait_s=2.0):
            raise
        run.error, run.lost = watch.lost(), True
    finally:
        restore_sigterm()
        run.close()
    return _finish(cfg, run_dir, log, t0, run.error)


def _prepare(cfg: Config, resume: Resumption | None) -> tuple[Path, str, EventLog]:
    """The run directory (config.json, logs/, an earlier run's files cleared unless resuming), the run's
    id and its event log, with `run_start` for a new run."""
    run_dir = Path(cfg.launch.out)
    if resume is None:
        shutil.rmtree(run_dir / "logs", ignore_errors=True)  # logs of an earlier run in this directory
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "coordinator.addr") + (() if resume else ("events.jsonl",)):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    run_id = resume.run_id if resume else f"run-{secrets.token_hex(4)}"
    if resume:
        _cut_torn_line(run_dir / "events.jsonl")  # a launcher killed mid-record: no half line mid-log
    log = EventLog(run_dir / "events.jsonl", who="launcher")
    if resume is None:
        log.emit("run_start", replicas=cfg.run.replicas, steps=cfg.run.steps, microbatches=cfg.run.microbatches,
                 exact=cfg.run.exact, seed=cfg.run.seed, faults=cfg.faults.spec, recovery=cfg.run.recovery,
                 run_id=run_id, group_size=cfg.parallel.group_size, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    return run_dir, run_id, log


class _Launch:
    """One launch's processes and state, in the order they start: `start` (coordinator, standbys, agents,
    the watch; a resumed run's next generation), `generations` (workers until a verdict, whole-job
    restarts between), `shut_down`, and `close` (everything it started, killed, in every case)."""

    def __init__(self, cfg: Config, log: EventLog, view: LiveView, worker_cmd: list[str] | None):
        self.cfg, self.log, self.view, self.worker_cmd = cfg, log, view, worker_cmd
        self.held = hold_port(cfg)
        self.zygote = fork_server(cfg, self.held) if worker_cmd is None else None
        self.procs: list[subprocess.Popen | Forked] = []
        self.agents: AgentSet | None = None
        self.watch: GenerationWatch | None = None
        self.error: str | None = "launcher failed"
        self.lost = False  # the coordinator was lost: the nodes' memory stays for `unbroken resume`
        self.generation, self.source = 0, ""

    def start(self, run_dir: Path, run_id: str, t0: float, resume: Resumption | None, refused: str | None) -> None:
        """The control plane: the coordinator (and its standbys with etcd), the store's run id, snapshot
        agents, the launcher-side faults not yet fired, the watch; a resumed run's next generation."""
        cfg = self.cfg
        coordinator, self.address = start_coordinator(cfg, run_dir, held=self.held, zygote=self.zygote, refused=refused)
        self.procs.append(coordinator)
        if cfg.coord.store:  # etcd: standbys beside it; the run has lost its coordinator once all are gone
            coordinator = Coordinators([coordinator] + [start_coordinator(cfg, run_dir, n, zygote=self.zygote,
                                                                           refused=refused)[0]
                                                        for n in range(1, 1 + cfg.coord.standbys)])
            self.procs.extend(coordinator.procs[1:])
        self.coordinator = coordinator
        self.raw = raw = connect(self.address)
        raw.set(keys.run_id(), run_id)  # whose keys these are (an etcd namespace outlives the run)
        if cfg.snapshot.enabled:
            self.agents = AgentSet(cfg, self.address, raw, run_id, run_dir, self.log, self.zygote)
        faults = parse(cfg.faults.spec, cfg.run.replicas, cfg.run.steps, group_size=cfg.parallel.group_size)
        fired = already_fired(faults, resume.fired) if resume else set()
        self.chaos = Chaos(tuple(f for n, f in enumerate(faults) if n not in fired), cfg, self.log, self.agents, run_id)
        self.watch = GenerationWatch(cfg, self.log, self.view, run_dir, t0, self.chaos, self.agents,
                                     lambda: wake(raw), coordinator)
        if resume:  # one more whole-job restart of the run, into a fresh store: the next generation
            for n in fired:
                raw.set(keys.fired(n), "1")  # trainers' faults.Injector: fired before, not again
            self.generation = resume.generation
            self.source = restore_source(cfg.run.recovery, self.agents is not None, cfg.checkpoint.every > 0)
            raw.set(keys.generation(), str(self.generation))
            self.watch.offset = (run_dir / "events.jsonl").stat().st_size  # the watch reads only new records
            self.watch.last_step = resume.last_step
            self.log.emit("restart", generation=self.generation, reason=f"resumed after: {resume.reason}",
                          source=self.source, resumed=True)

    def generations(self, run_dir: Path, run_id: str) -> str | None:
        """Start every group's workers and watch them to a verdict; after a "restart" verdict (a whole-job
        loss with persistence), restart them all as the next generation, at most launch.max_job_restarts
        times. Returns the run's error (None: done). Raises _CoordinatorLost when the store went with it."""
        cfg, raw, watch = self.cfg, self.raw, self.watch
        while True:
            workers = {r: start_worker(cfg, self.worker_cmd or DEFAULT_WORKER, run_dir, self.address, r,
                                       self.generation, self.source, run_id, watch.last_step, self.zygote)
                       for r in range(cfg.run.replicas)}
            self.procs.extend(workers.values())
            outcome, error = watch.run(PrefixStore(keys.generation_prefix(self.generation), raw), workers)
            if outcome == "lost":  # the store went with the coordinator: nothing to tell anyone, end
                raise _CoordinatorLost(error)
            if outcome != "restart":
                return error
            if self.generation >= cfg.launch.max_job_restarts:
                return f"gave up after {cfg.launch.max_job_restarts} restarts ({error})"
            self.source = _restart(cfg, raw, workers, self.agents, self.chaos, watch.last_step, self.log, error)
            self.generation += 1
            raw.set(keys.generation(), str(self.generation))
            wake(raw)
            self.log.emit("restart", generation=self.generation, reason=error, source=self.source)

    def shut_down(self) -> None:
        """Tell the coordinator the run has ended, and give it 10 s to write its last records."""
        self.raw.set(keys.shutdown(), "1")
        wake(self.raw)
        try:
            self.coordinator.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # killed below: nothing it holds matters once the run has ended

    def close(self) -> None:
        """Kill everything the launch started; call once, however it ended."""
        self.view.close()
        if self.agents is not None:
            # before the coordinator: agents talk to its store until they die. A lost coordinator
            # leaves the nodes' memory in place (a node outlives it): `unbroken resume` restores from it
            self.agents.close(keep_memory=self.lost)
        for p in self.procs:
            kill_tree(p)
        if self.zygote is not None:
            self.zygote.close()


def _sigterm_interrupts() -> Callable[[], None]:
    """Make SIGTERM (`kill PID`, a scheduler's preemption) end the run as Ctrl-C does: the children
    (coordinator, agents, trainers) are killed and the summary written, none left orphaned. Python's
    default SIGTERM ends the launcher at once and skips that. Returns the undo; a no-op off the main
    thread, where signal handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, before)


def _restart(cfg: Config, raw, workers, agents: AgentSet | None, chaos: Chaos, last_step: int,
             log: EventLog, reason: str | None) -> str:
    """Stop every trainer of the generation, mend what a lost node took, and choose the restore source."""
    for p in workers.values():
        kill_tree(p)
    chaos.before_restart(last_step)
    memory_ok = agents is not None
    if agents is not None:
        lost = chaos.take_lost_nodes()
        if lost and agents.replace(lost, rebuild=True) is None:
            memory_ok = False  # more lost than the parity covers: only a checkpoint can help
    return restore_source(cfg.run.recovery, memory_ok, cfg.checkpoint.every > 0)


def _finish(cfg: Config, run_dir: Path, log: EventLog, t0: float, error: str | None) -> RunResult:
    ok, summary, error = finish_run(run_dir, cfg, log, t0, error)
    return RunResult(ok, run_dir, summary["steps_committed"], summary["last_committed_step"], error, summary)


def _cut_torn_line(events: Path) -> None:
    """Cut a last line that lacks its newline (its writer was killed mid-record) before appending."""
    data = events.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(events, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class _CoordinatorLost(Exception):
    """The coordinator's process ended before the run did (killed, OOM, its host gone): its store is gone."""
