"""The TCP sockets of this process's replica-group process groups, so that a survivor can shut them.

Owns: recording which sockets the group's gloo process groups opened (`recorded`, around their creation:
the default group, its mesh's sub-groups, a re-formed group's) and shutting them (`shut_recorded`). Does
not own the groups themselves (parallelize.py, trainer/replan_reform.py) nor deciding when a group is broken (trainer/lifecycle.py).

Why it exists: a rank blocked in a receive from a peer that is alive but gave up on the group (stage 0's
rank, waiting on the activation gradient of stage 1's survivor) wakes only when that peer's socket
closes. A gloo group closes its sockets when its last reference goes, and something a survivor cannot
drop holds its context (by my reading, a receive still pending on gloo's own thread, itself waiting on
the blocked rank). Measured: `destroy_process_group`, every reference dropped, then a garbage collection
left the peer blocked until torchrun stopped the survivor 11 s later, long after the survivors' claim
window of 3 s; the group's Python object was gone (a weakref said so). `shutdown(2)`
on the survivor's end ends the peer's receive with "Connection closed by peer" at once, whoever holds
the socket, and leaves the descriptor to its owner to close.

Sockets are named by inode (/proc/self/fd), which no later socket reuses while it is open; without /proc
nothing is recorded and nothing is shut. A socket another thread opened while a group formed (a store
client reconnecting) is recorded too: shut, its thread reconnects, as after any dropped connection.
NCCL's communicators wait on the GPU, not on these sockets: there a peer's own timeout wakes it.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

_GROUP: set[int] = set()  # inodes of the sockets the group's process groups opened


def open_sockets() -> frozenset[int]:
    """The inodes of this process's open sockets; empty where /proc is absent. One listdir and one readlink
    per descriptor."""
    return frozenset(inode for _, inode in _descriptors())


@contextmanager
def recorded() -> Iterator[None]:
    """Record the sockets opened inside the block as the group's (wrap the creation of a replica group's
    process group, or of its sub-groups, and nothing else)."""
    before = open_sockets()
    try:
        yield
    finally:
        _GROUP.update(open_sockets() - before)


def shut_recorded() -> int:
    """Shut down both directions of every recorded connection still open (the descriptors stay open for
    their owners to close; listening sockets are left alone); returns how many. Call once the group is
    broken and this rank leaves it, before anything waits on a peer of it (the survivor's claim): shut,
    the group cannot be used again."""
    shut = 0
    for fd, inode in _descriptors():
        if inode not in _GROUP:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile
            continue
        try:
            # not a listening one: gloo's listener, shut, fails its accept and aborts the process (SIGABRT)
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:  # its peer closed it already
            pass
        finally:
            s.detach()  # not ours to close
    _GROUP.clear()
    return shut


def _descriptors() -> list[tuple[int, int]]:
    """(descriptor, inode) of each open socket of this process."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing (the listing's own descriptor, too)
            continue
        if target.startswith("socket:["):
            found.append((int(name), int(target[8:-1])))
    return found
