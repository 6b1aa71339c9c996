"""The launcher's hold on the processes it starts: a process and everything under it.

Owns: finding every live process under a pid (Linux /proc) and killing such a tree. Does not own: starting
processes or deciding when to stop them (launch.py). Why a tree: a torchrun agent starts its workers in
sessions of their own, so killing the agent alone leaves them running, re-parented to init.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


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


def signal_tree(p: subprocess.Popen, sig: int) -> None:
    """Send `sig` to `p` and every process under it (listed before any is signalled: a process whose parent
    died is re-parented and could no longer be found); does not reap. A no-op once `p` has ended."""
    if p.poll() is not None:
        return
    for pid in process_tree(p.pid):  # the agent first, so it restarts nothing; its workers are listed already
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL `p` and every process under it, and reap `p`. A torchrun agent starts its workers in
    sessions of their own: killing the agent alone would leave them running, re-parented to init."""
    signal_tree(p, signal.SIGKILL)
    if p.poll() is None:
        p.wait()
