"""The launcher's watch over one generation of workers: their exits reported to the store (as a torchrun
agent reports its workers'), the event log tailed (progress, launcher-side faults, a trainer's error), the
generation's verdict (done, failed, restart, timeout, lost), and lost snapshot agents replaced.

Owns: `GenerationWatch` (one generation, from its workers' start to its verdict), `ExitWait` (sleeping
until a worker ends), `Coordinators` (a leader and its standbys seen as one). Does not own: starting
processes (starting.py), whole-job restarts or the run directory (launch.py), liveness verdicts
(the coordinator).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed import DistError

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.observe.progress import LiveView
from unbroken.policy.snapshotting import needs_restart
from unbroken.runtime.launcher.agents import AgentSet
from unbroken.runtime.launcher.chaos import Chaos
from unbroken.runtime.launcher.processes import AgentGroup
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import finished_among, last_committed, read

# Records the watch neither acts on nor shows: most of the log (a few per replica and step), so they
# are skipped unparsed (every record starts with its kind, events.py).
_UNREAD = tuple(f'{{"event":"{kind}"'.encode() for kind in ("compute", "reduce", "applied"))


class GenerationWatch:
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
        exits = ExitWait(workers)
        try:
            outcome = self._loop(store, workers, exits)
            # A trainer that lost the store reports an error (or exits) in the same round that the
            # coordinator's death could be seen, after its check: the cause is the coordinator (seen in
            # CI: "failed", then the shutdown's store write ended the launcher in a traceback).
            if outcome[0] != "done" and self.coordinator is not None and self.coordinator_gone():
                return "lost", self.lost()
            return outcome
        except DistError:
            if self.coordinator is not None and self.coordinator_gone(wait_s=2.0):
                return "lost", self.lost()
            if self.cfg.coord.store:  # etcd, a cluster of its own: none of its members answers
                return "lost", self.lost("the store was lost (no etcd member answers)")
            raise
        finally:
            exits.close()

    def coordinator_gone(self, wait_s: float = 0.0) -> bool:
        """Whether the coordinator's process ended, after waiting up to `wait_s` s for it to."""
        try:
            self.coordinator.wait(timeout=wait_s) if wait_s else None
        except subprocess.TimeoutExpired:
            pass
        return self.coordinator.poll() is not None

    def lost(self, what: str = "the coordinator was lost") -> str:
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

    def _loop(self, store, workers: dict[int, subprocess.Popen], exits: ExitWait) -> tuple[str, str | None]:
        """Round after round until a verdict: report exits, tail the log, read the store, decide."""
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
            if self.coordinator is not None and self.coordinator_gone():
                return "lost", self.lost()
            self._report_exits(store, workers, exits, reported)
            self._replace_lost_agents(workers, reported)
            self._tail(workers)
            if self.worker_error:  # an exception in a trainer is a bug: restarting would repeat it
                return "failed", self.worker_error
            verdict = self._verdict(store, workers, reported)
            if verdict is not None:
                return verdict

    def _report_exits(self, store, workers: dict[int, subprocess.Popen], exits: ExitWait, reported: set[int]) -> None:
        """Each worker's exit, once: logged, and a failure written to the store, as a torchrun agent
        reports its workers' ends; the coordinator woken to reach its verdict at once."""
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

    def _verdict(self, store, workers: dict[int, subprocess.Popen], reported: set[int]) -> tuple[str, str | None] | None:
        """The generation's end, if it has come: done, failed, restart or timeout (None: go on). Releases
        finished groups' agents and replaces lost ones (parallel.replace_after) on the way."""
        finished, dead = self._read_store(store, workers)
        for r, p in workers.items():
            if isinstance(p, AgentGroup):
                if r in finished:  # its agents may linger in torchrun's exit barrier
                    p.finished()
                for j in p.replace_lost(self.cfg.parallel.replace_after):
                    self.log.emit("agent_replaced", replica=r, slot=j)
        lost = [r for r in workers if r not in finished and (r in dead or (r in reported and workers[r].returncode))]
        live = len(workers) - len(lost) - len(finished)
        last = self.last_step  # read from the store only for a verdict below
        if lost and not finished and needs_restart(self.cfg.run.recovery, len(lost), live):
            last = last_committed(store, last)
            if self.persistent:
                return "restart", f"{len(lost)} of {len(workers)} replicas lost at step {last + 1}"
            return "failed", f"every replica was lost; last committed step: {last}"
        if all(r in reported or r in lost for r in workers):
            if finished:
                return "done", None  # the rest are zombies (declared dead, still stopped): killed on exit
            return "failed", f"every replica was lost; last committed step: {last_committed(store, last)}"
        if time.time() - self.t0 > self.cfg.coord.run_timeout:
            return "timeout", f"run timed out after {self.cfg.coord.run_timeout:.0f} s"
        return None

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


class ExitWait:
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




class Coordinators:
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
