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


# (pid, tid) -> the thread's name (/proc comm), for every thread `snapshot` read: gloo names its native
# threads (gloo_tcp_loop: its sockets' I/O; pt_gloo_runloop: the process group's work queue), while
# Python's threads (heartbeat, sidecar, watches) keep the process's name on Python 3.11
NAMES: dict[tuple[int, int], str] = {}
GLOO = ("gloo", "pt_gloo")  # name prefixes of gloo's threads


def snapshot(pids: Iterable[int]) -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU seconds (user + system) so far, for every thread of each live pid; records each
    thread's name in NAMES. A process or thread that ends while being read is left out."""
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
            NAMES[pid, int(tid)] = stat[stat.find("(") + 1:stat.rfind(")")]
    return out


def spent(before: Mapping[tuple[int, int], float], after: Mapping[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """CPU seconds each thread ran between two snapshots (a thread born in between counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


ROLES = ("trainer main", "trainer gloo", "trainer threads", "control")


def by_role(used: Mapping[tuple[int, int], float], trainers: Collection[int]) -> dict[str, float]:
    """Seconds summed by ROLES: "trainer main" (a trainer's main thread), "trainer gloo" (gloo's threads
    in a trainer: socket I/O and the work queue, the same bytes on both sides of a comparison), "trainer
    threads" (a trainer's other threads: unbroken's heartbeat, sidecar and watches) and "control"
    (every other process). Call after `snapshot` read the threads in `used`."""
    out = dict.fromkeys(ROLES, 0.0)
    for (pid, tid), s in used.items():
        gloo = NAMES.get((pid, tid), "").startswith(GLOO)
        role = ("control" if pid not in trainers else "trainer main" if tid == pid
                else "trainer gloo" if gloo else "trainer threads")
        out[role] += s
    return out
