"""The launcher holds the coordinator's port from its choice on (runtime/launcher/starting.py): the
coordinator serves the socket bound in the launcher, so the port cannot be taken while the coordinator
process starts and imports torch (before, the launcher bound port 0, closed it, and passed the number:
any process could take the port in those seconds). Real processes: the coordinator module, a TCPStore
client, a second socket trying to bind the port."""
from __future__ import annotations

import errno
import socket

import pytest

from unbroken.config import Config
from unbroken.runtime.store.client import connect
from unbroken.runtime.launcher.processes import kill_tree
from unbroken.runtime.launcher.resume import _still_running
from unbroken.runtime.launcher.starting import fork_server, hold_port, start_coordinator
from unbroken.runtime.launcher.zygote import Forked

pytestmark = pytest.mark.timeout(60)


def bind(port: int) -> int:
    """0 when `port` on loopback is free to bind, else the errno. With SO_REUSEADDR, as a server binds
    (TCPStore's does): the killed server's connections in TIME_WAIT do not count, a listening socket does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno
    return 0


def test_the_coordinators_port_is_held_from_its_choice_and_freed_when_it_exits(tmp_path):
    (tmp_path / "logs").mkdir()
    p, address = start_coordinator(Config(), tmp_path)
    try:
        port = int(address.rsplit(":", 1)[1])
        # at once: the coordinator is still importing torch, and the port is already taken
        assert p.poll() is None and bind(port) == errno.EADDRINUSE
        store = connect(address, timeout_s=30)  # and it is the coordinator that answers on it
        store.set("probe", "1")
        assert store.get("probe") == b"1"
        assert (tmp_path / "coordinator.addr").read_text().strip() == address
    finally:
        kill_tree(p)  # SIGKILL, reaped
    assert bind(port) == 0  # the launcher kept no copy: the port is free once the coordinator is gone


def test_a_forked_coordinator_serves_the_held_port_and_resume_sees_it_alive_by_pid_and_start(tmp_path):
    """Under the default launcher the fork server forks the coordinator: it serves the port the launcher
    held, and `unbroken resume` knows it is still running by its pid and start time (its command line is
    the fork server's), and not once that pid's process is another or gone."""
    cfg = Config()
    (tmp_path / "logs").mkdir()
    held = hold_port(cfg)
    port = held.getsockname()[1]
    zygote = fork_server(cfg, held)
    try:
        p, address = start_coordinator(cfg, tmp_path, held=held, zygote=zygote)
        assert isinstance(p, Forked) and address == f"127.0.0.1:{port}"
        assert bind(port) == errno.EADDRINUSE
        store = connect(address, timeout_s=30)
        store.set("probe", "1")
        assert store.get("probe") == b"1"
        assert _still_running(tmp_path)
        started = (tmp_path / "logs" / "coordinator.started").read_text()
        (tmp_path / "logs" / "coordinator.started").write_text(str(int(started) + 1))  # a reused pid
        assert not _still_running(tmp_path)
        (tmp_path / "logs" / "coordinator.started").write_text(started)
        kill_tree(p)
        assert p.returncode == -9 and not _still_running(tmp_path)
    finally:
        zygote.close()
    assert bind(port) == 0  # neither the fork server nor the launcher kept a copy
