"""CPU seconds of a time-sliced side, per process and thread, from /proc: where a step's CPU goes.

Owns: reading every thread's user + system time of a set of processes (`snapshot`), the difference of two
snapshots taken while the side is frozen (`spent`: what ran in between, nothing else), and summing it by
role (`by_role`). Does not own: which processes are trainers (the caller says), freezing them
(overhead.Side). Linux only (/proc/<pid>/task/<tid>/stat).

Why a benchmark wants it: with more trainer processes than cores, the wall-clock ratio is the trainers'
extra CPU plus every control-plane process's CPU (coordinator, torchrun agents, launcher), all taken
from the training; on a GPU node the control plane runs on cores the trainers do not use. CPU seconds
per step split the two.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping

TICK = os.sysconf("SC_CLK_TCK")  # /proc times are in clock ticks (100 a second on Linux)


def snapshot(pids: Iterable[int]) -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU seconds (user + system) so far, for every thread of each live pid. A process or
    thread that ends while being read is left out."""
    out: dict[tuple[int, int], float] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            # fields after the command name (which may hold spaces, inside parentheses): utime is the
            # 14th field of the line, stime the 15th, i.e. [11] and [12] after the closing parenthesis
            rest = stat[stat.rfind(")") + 2:].split()
            out[pid, int(tid)] = (int(rest[11]) + int(rest[12])) / TICK
    return out


def spent(before: Mapping[tuple[int, int], float], after: Mapping[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """CPU seconds each thread ran between two snapshots (a thread born in between counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def by_role(used: Mapping[tuple[int, int], float], trainers: Collection[int]) -> dict[str, float]:
    """Seconds summed as "trainer main" (a trainer's main thread), "trainer threads" (a trainer's other
    threads: gloo's, heartbeat, sidecar, watches) and "control" (every other process)."""
    out = {"trainer main": 0.0, "trainer threads": 0.0, "control": 0.0}
    for (pid, tid), s in used.items():
        role = "control" if pid not in trainers else "trainer main" if tid == pid else "trainer threads"
        out[role] += s
    return out
