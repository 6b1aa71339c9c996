"""The local launcher: coordinator, snapshot agents, one worker process per replica group; then watch.

Owns: the run directory (config.json, events.jsonl, logs/), when processes start (how: starting.py),
reporting each worker's exit to the store (as a torchrun
agent sees its workers end), whole-job restarts (a new *generation*: fresh membership under the store
prefix g{N}/, every trainer restarted and resumed from the agents' memory or the latest checkpoint), the
launcher-side faults (chaos.py), live progress, summary.json, and killing everything it started.
Does not own: liveness verdicts (coordinator), training, what a restart loads (persistence.py).
"""
from __future__ import annotations

import json
import os
import secrets
import select
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
from unbroken.policy.snapshotting import needs_restart, restore_source
from unbroken.observe.progress import LiveView
from unbroken.observe.runs import finish_run
from unbroken.runtime.launcher.processes import AgentGroup, kill_tree
from unbroken.runtime.launcher.agents import AgentSet
from unbroken.runtime.launcher.chaos import Chaos
from unbroken.runtime.launcher.resume import Resumption, already_fired
from unbroken.runtime.launcher.starting import DEFAULT_WORKER, fork_server, hold_port, start_coordinator, start_worker
from unbroken.runtime.launcher.zygote import Forked
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect, finished_among, last_committed, read
from unbroken.runtime.store.client import preflight as store_preflight
from unbroken.runtime.store.watch import wake
from unbroken.runtime.coordinator.metrics import preflight

# Records the watch neither acts on nor shows: most of the log (a few per replica and step), so they
# are skipped unparsed (every record starts with its kind, events.py).
_UNREAD = tuple(f'{{"event":"{kind}"'.encode() for kind in ("compute", "reduce", "applied"))


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
    t0 = time.time()
    if resume is None:
        log.emit("run_start", replicas=cfg.run.replicas, steps=cfg.run.steps, microbatches=cfg.run.microbatches,
                 exact=cfg.run.exact, seed=cfg.run.seed, faults=cfg.faults.spec, recovery=cfg.run.recovery,
                 run_id=run_id, group_size=cfg.parallel.group_size, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    procs: list[subprocess.Popen | Forked] = []
    agents: AgentSet | None = None
    held = hold_port(cfg)
    zygote = fork_server(cfg, held) if worker_cmd is None else None
    view = LiveView(cfg.run.steps, title, enabled=cfg.launch.progress)
    error: str | None = "launcher failed"
    restore_sigterm = _sigterm_interrupts()
    lost = False  # the coordinator was lost: the nodes' memory stays for `unbroken resume`
    watch: _Watch | None = None
    try:
        coordinator, address = start_coordinator(cfg, run_dir, held=held, zygote=zygote, refused=reform_refused)
        procs.append(coordinator)
        if cfg.coord.store:  # etcd: standbys beside it; the run has lost its coordinator once all are gone
            coordinator = _Coordinators([coordinator] + [start_coordinator(cfg, run_dir, n, zygote=zygote,
                                                                            refused=reform_refused)[0]
                                                         for n in range(1, 1 + cfg.coord.standbys)])
            procs.extend(coordinator.procs[1:])
        raw = connect(address)
        raw.set(keys.run_id(), run_id)  # whose keys these are (an etcd namespace outlives the run)
        if cfg.snapshot.enabled:
            agents = AgentSet(cfg, address, raw, run_id, run_dir, log, zygote)
        faults = parse(cfg.faults.spec, cfg.run.replicas, cfg.run.steps, group_size=cfg.parallel.group_size)
        fired = already_fired(faults, resume.fired) if resume else set()
        chaos = Chaos(tuple(f for n, f in enumerate(faults) if n not in fired), cfg, log, agents, run_id)
        watch = _Watch(cfg, log, view, run_dir, t0, chaos, agents, lambda: wake(raw), coordinator)
        generation, source = 0, ""
        if resume:  # one more whole-job restart of the run, into a fresh store: the next generation
            for n in fired:
                raw.set(keys.fired(n), "1")  # trainers' faults.Injector: fired before, not again
            generation = resume.generation
            source = restore_source(cfg.run.recovery, agents is not None, cfg.checkpoint.every > 0)
            raw.set(keys.generation(), str(generation))
            watch.offset = (run_dir / "events.jsonl").stat().st_size  # the watch reads only new records
            watch.last_step = resume.last_step
            log.emit("restart", generation=generation, reason=f"resumed after: {resume.reason}", source=source,
                     resumed=True)
        while True:
            workers = {r: start_worker(cfg, worker_cmd or DEFAULT_WORKER, run_dir, address, r, generation,
                                        source, run_id, watch.last_step, zygote) for r in range(cfg.run.replicas)}
            procs.extend(workers.values())
            outcome, error = watch.run(PrefixStore(keys.generation_prefix(generation), raw), workers)
            if outcome == "lost":  # the store went with the coordinator: nothing to tell anyone, end
                raise _CoordinatorLost(error)
            if outcome != "restart":
                break
            if generation >= cfg.launch.max_job_restarts:
                error = f"gave up after {cfg.launch.max_job_restarts} restarts ({error})"
                break
            source = _restart(cfg, raw, workers, agents, chaos, watch.last_step, log, error)
            generation += 1
            raw.set(keys.generation(), str(generation))
            wake(raw)
            log.emit("restart", generation=generation, reason=error, source=source)
        raw.set(keys.shutdown(), "1")
        wake(raw)
        try:
            coordinator.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # killed below: nothing it holds matters once the run has ended
    except KeyboardInterrupt:
        error = "interrupted"
    except _CoordinatorLost as e:
        error, lost = str(e), True
    except DistError:
        # A store call after the watch (the shutdown's write, a restart's) that found the coordinator gone
        # ends the run as the watch's "lost" does. The watch sees the coordinator's end only once it is
        # reaped: SIGKILLed as its trainers saw the store go, it was not yet, the watch said "failed", and
        # the shutdown's write raised: no run_end, and no memory kept for `unbroken resume`.
        if watch is None or watch.coordinator is None or not watch._coordinator_gone(wait_s=2.0):
            raise
        error, lost = watch._lost(), True
    finally:
        restore_sigterm()
        view.close()
        if agents is not None:
            # before the coordinator: agents talk to its store until they die. A lost coordinator
            # leaves the nodes' memory in place (a node outlives it): `unbroken resume` restores from it
            agents.close(keep_memory=lost)
        for p in procs:
            kill_tree(p)
        if zygote is not None:
            zygote.close()
    return _finish(cfg, run_dir, log, t0, error)


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


class _Coordinators:
    """A leader and its standbys (etcd) seen as one coordinator by the watch: ended once all ended."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        return None if None in codes else codes[0]

    def wait(self, timeout: float) -> int | None:
        """Wait until one ends (the leader, at the end of the run) or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        while all(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("coordinators", timeout)
            time.sleep(0.05)
        return self.poll()


class _CoordinatorLost(Exception):
    """The coordinator's process ended before the run did (killed, OOM, its host gone): its store is gone."""


class _ExitWait:
    """Sleeps until a worker process ends or a timeout passes: one pidfd per worker, so an exit wakes
    the launcher at once where it polled every 20 ms before (0.8 ms of CPU a step of a 4-replica run).
    Without pidfds (a kernel before 5.3) it sleeps 20 ms at most: exits are still seen within 20 ms."""

    def __init__(self, workers: dict[int, subprocess.Popen]):
        self.fds: dict[int, int] | None = {}
        try:
            for r, p in workers.items():
                self.fds[r] = os.pidfd_open(p.pid)
        except (AttributeError, OSError):  # no pidfd_open here, or the process was reaped already
            self.close()
            self.fds = None

    def wait(self, seconds: float) -> None:
        if self.fds is None:
            time.sleep(min(seconds, 0.02))
        else:
            select.select(list(self.fds.values()), [], [], seconds)

    def forget(self, r: int) -> None:
        """Stop waiting on worker r (reported): its pidfd stays readable, and would wake every wait."""
        if self.fds is not None and r in self.fds:
            os.close(self.fds.pop(r))

    def close(self) -> None:
        for fd in (self.fds or {}).values():
            os.close(fd)
        self.fds = {}


class _Watch:
    """Watches one generation of workers until it finishes, fails, needs a restart, or times out."""

    def __init__(self, cfg: Config, log: EventLog, view: LiveView, run_dir: Path, t0: float, chaos: Chaos,
                 agents: AgentSet | None, wake: Callable[[], None], coordinator: subprocess.Popen | None = None):
        self.cfg, self.log, self.view, self.t0, self.chaos, self.agents = cfg, log, view, t0, chaos, agents
        self.wake = wake  # the coordinator's loop: an exit is a verdict it should reach at once
        self.coordinator = coordinator  # its end ends the run (the store is gone)
        self.events, self.offset, self.last_step = run_dir / "events.jsonl", 0, -1
        self.persistent = cfg.snapshot.enabled or cfg.checkpoint.every > 0
        self.worker_error: str | None = None

    def run(self, store, workers: dict[int, subprocess.Popen]) -> tuple[str, str | None]:
        """Watch until the generation ends: ("done" | "failed" | "timeout" | "restart" | "lost", error).
        "lost": the coordinator's process ended, and with it the store (a store call that fails because
        of it counts the same)."""
        exits = _ExitWait(workers)
        try:
            outcome = self._loop(store, workers, exits)
            # A trainer that lost the store reports an error (or exits) in the same round that the
            # coordinator's death could be seen, after its check: the cause is the coordinator (seen in
            # CI: "failed", then the shutdown's store write ended the launcher in a traceback).
            if outcome[0] != "done" and self.coordinator is not None and self._coordinator_gone():
                return "lost", self._lost()
            return outcome
        except DistError:
            if self.coordinator is not None and self._coordinator_gone(wait_s=2.0):
                return "lost", self._lost()
            if self.cfg.coord.store:  # etcd, a cluster of its own: none of its members answers
                return "lost", self._lost("the store was lost (no etcd member answers)")
            raise
        finally:
            exits.close()

    def _coordinator_gone(self, wait_s: float = 0.0) -> bool:
        try:
            self.coordinator.wait(timeout=wait_s) if wait_s else None
        except subprocess.TimeoutExpired:
            pass
        return self.coordinator.poll() is not None

    def _lost(self, what: str = "the coordinator was lost") -> str:
        """The one line for a lost coordinator, with the last step whose record is in the log (read
        directly: firing launcher-side faults on the way, as `_tail` would, is no longer wanted)."""
        with open(self.events, "rb") as f:
            f.seek(self.offset)
            lines = f.read().splitlines()
        for line in lines:
            if line.startswith(b'{"event":"step"'):
                try:
                    self.last_step = max(self.last_step, json.loads(line)["step"])
                except (ValueError, KeyError):
                    pass  # a torn last line
        return f"{what}; last committed step: {self.last_step}"

    def _loop(self, store, workers: dict[int, subprocess.Popen], exits: _ExitWait) -> tuple[str, str | None]:
        reported: set[int] = set()
        rounds = 0
        # this generation's store, as last read: (epoch, the dead) and (nfinished, the finished)
        self.dead: tuple[bytes | None, set[int]] = (None, set())
        self.finished: tuple[int, frozenset[int]] = (0, frozenset())
        while True:
            if rounds:
                # Exits are reported at once (the coordinator's fast path to a verdict): the wait
                # wakes on a worker's end. The rest (events, store reads) runs every 100 ms: it is CPU
                # the trainers could use. Launcher-side faults still pending (node, crash-all) need a
                # 20 ms pace: they fire on the step record they wait for, inside the step they name.
                exits.wait(0.02 if self.chaos.pending else 0.1)
            rounds += 1
            if self.coordinator is not None and self._coordinator_gone():
                return "lost", self._lost()
            for r, p in workers.items():
                code = p.poll()
                if code is not None and r not in reported:
                    reported.add(r)
                    exits.forget(r)
                    self.log.emit("exit", replica=r, code=code)
                    if code != 0:  # a clean exit is a finished replica, not a failure
                        # unless a rank already said why its group left (Coordination.leave): torchrun's
                        # exit follows that report and must not replace the cause with its consequence
                        store.compare_set(keys.exited(r), "", str(code))
                        store.add(keys.exits(), 1)
                        self.wake()
            self._replace_lost_agents(workers, reported)
            self._tail(workers)
            if self.worker_error:  # an exception in a trainer is a bug: restarting would repeat it
                return "failed", self.worker_error
            finished, dead = self._read_store(store, workers)
            for r, p in workers.items():
                if isinstance(p, AgentGroup):
                    if r in finished:  # its agents may linger in torchrun's exit barrier
                        p.finished()
                    for j in p.replace_lost(self.cfg.parallel.replace_after):
                        self.log.emit("agent_replaced", replica=r, slot=j)
            lost = [r for r in workers if r not in finished and (r in dead
                                                                 or (r in reported and workers[r].returncode))]
            live = len(workers) - len(lost) - len(finished)
            last = self.last_step  # read from the store only for a verdict below
            if lost and not finished and needs_restart(self.cfg.run.recovery, len(lost), live):
                last = last_committed(store, last)
                why = f"{len(lost)} of {len(workers)} replicas lost at step {last + 1}"
                if self.persistent:
                    return "restart", why
                return "failed", f"every replica was lost; last committed step: {last}"
            if all(r in reported or r in lost for r in workers):
                if finished:
                    return "done", None  # the rest are zombies (declared dead, still stopped): killed on exit
                return "failed", f"every replica was lost; last committed step: {last_committed(store, last)}"
            if time.time() - self.t0 > self.cfg.coord.run_timeout:
                return "timeout", f"run timed out after {self.cfg.coord.run_timeout:.0f} s"

    def _read_store(self, store, workers: dict[int, subprocess.Popen]) -> tuple[frozenset[int], set[int]]:
        """The finished and the dead among `workers`: two round trips, unless a count moved.
        Members are declared dead only in a new epoch, so `dead/{r}` is re-read when `epoch` moves."""
        epoch = read(store, keys.epoch())
        if epoch != self.dead[0]:
            self.dead = (epoch, {r for r in workers if store.check([keys.dead(r)])})
        self.finished = finished_among(store, workers, self.finished)
        return self.finished[1], self.dead[1]

    def _tail(self, workers: dict[int, subprocess.Popen]) -> None:
        with open(self.events, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        records = [json.loads(line) for line in chunk[:end].splitlines()
                   if line.strip() and not line.startswith(_UNREAD)]
        for r in records:
            if r["event"] == "worker_error":
                self.worker_error = f"replica {r['replica']} failed: {r['error']}"
            if r["event"] == "step" and r["step"] > self.last_step:
                self.last_step = r["step"]
                self.chaos.on_committed(r["step"], workers)
        self.view.feed(records)

    def _replace_lost_agents(self, workers: dict[int, subprocess.Popen], reported: set[int]) -> None:
        """Under live recovery, start a fresh agent for each node a fault took, once every trainer of those
        nodes has its exit reported: the survivors keep training and snapshotting (adopting the lost
        replicas' shares), and a replacement node's agent must take those shares. Starting one blocks
        this loop until it serves (~0.8 s here: it imports torch), and the exits it would hold back are
        the coordinator's fast path to its verdict (`recovery.py`'s node loss: 0.8 s to `member_dead`
        while the agent started first). Call every round, after the exits are reported."""
        lost = self.chaos.lost_nodes
        if self.agents is None or self.cfg.run.recovery != "live" or not lost:
            return
        node_of = self.cfg.topology().node_of
        if all(r in reported for r in workers if node_of(r) in lost):
            self.agents.replace(self.chaos.take_lost_nodes(), rebuild=False)
