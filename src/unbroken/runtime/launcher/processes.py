"""The launcher's hold on the processes it starts: a process and everything under it.

Owns: finding every live process under a pid (Linux /proc) and killing such a tree. Does not own: starting
processes or deciding when to stop them (launch.py). Why a tree: a torchrun agent starts its workers in
sessions of their own, so killing the agent alone leaves them running, re-parented to init.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot, /proc/PID/stat field 22), or None if it is gone: with the
    pid, it names one process (a pid alone can be reused; a forked process's command line is its parent's)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_tree(root: int) -> list[int]:
    """`root` and every live process under it (Linux /proc), parents before their children."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            parents.setdefault(ppid, []).append(int(d))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


class AgentGroup:
    """One replica group started as one torchrun agent per rank (parallel.on_rank_loss=replan: as a group
    spanning hosts, so a rank's death does not make torchrun stop its siblings), seen as one process.

    Ended once every agent ended, or, after `finished()` (the group applied the last step), once every
    agent still running has no worker left: such an agent waits in torchrun's exit barrier for a lost
    rank's agent that will never come (300 s). Its code is 0 when any rank finished cleanly (a shrunk
    group's survivor), else the first agent's non-zero code."""

    def __init__(self, procs: list[subprocess.Popen], start: Callable[[int], subprocess.Popen] | None = None):
        self.procs = procs
        self.pid = procs[0].pid  # what the launcher's exit wait watches (the rest: its polling)
        self._finished = False
        self._start = start  # start(j): a new agent for rank slot j
        self._ended: dict[int, float] = {}  # slot -> when its agent was first seen ended (monotonic s)

    def finished(self) -> None:
        self._finished = True

    def replace_lost(self, after_s: float) -> list[int]:
        """Start a new agent for each slot whose agent ended with an error `after_s` s ago or more (a spare
        host arriving: it joins the rendezvous, and the group re-forms at its full plan). Call every
        launcher round; returns the slots replaced now. A finished group, or `after_s` < 0: none."""
        if after_s < 0 or self._finished or self._start is None:
            return []
        now, replaced = time.monotonic(), []
        for j, p in enumerate(self.procs):
            if p.poll() in (None, 0):
                continue
            if now - self._ended.setdefault(j, now) >= after_s:
                self.procs[j] = self._start(j)
                self._ended.pop(j)
                replaced.append(j)
        return replaced

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        if any(c is None and not (self._finished and len(process_tree(p.pid)) == 1)
               for p, c in zip(self.procs, codes)):
            return None
        ended = [c for c in codes if c is not None]
        return 0 if 0 in ended or len(ended) < len(codes) else next(c for c in ended if c)

    @property
    def returncode(self) -> int | None:
        return self.poll()


def signal_tree(p: subprocess.Popen | AgentGroup, sig: int) -> None:
    """Send `sig` to `p` and every process under it (listed before any is signalled: a process whose parent
    died is re-parented and could no longer be found); does not reap. A no-op once `p` has ended."""
    if isinstance(p, AgentGroup):
        for q in p.procs:
            signal_tree(q, sig)
        return
    if p.poll() is not None:
        return
    for pid in process_tree(p.pid):  # the agent first, so it restarts nothing; its workers are listed already
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(p: subprocess.Popen | AgentGroup) -> None:
    """SIGKILL `p` and every process under it, and reap `p`. A torchrun agent starts its workers in
    sessions of their own: killing the agent alone would leave them running, re-parented to init."""
    if isinstance(p, AgentGroup):
        for q in p.procs:
            kill_tree(q)
        return
    signal_tree(p, signal.SIGKILL)
    if p.poll() is None:
        p.wait()
