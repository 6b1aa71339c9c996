"""The local launcher's fork server (launcher/zygote.py) on its own: real forked processes, their exit
codes as Popen gives them (negative: killed by that signal), each with its own argv, environment and log,
none reading the server's request pipe; a held socket only in the child that keeps it; and a server that
finds threads running refuses to fork."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.runtime.launcher.test_starting import bind
from unbroken.runtime.launcher.zygote import Zygote

pytestmark = pytest.mark.timeout(90)
# OMP_NUM_THREADS=1, as the launcher sets it: with more, importing torch starts OpenMP's pool (a thread)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), *sys.path]), "OMP_NUM_THREADS": "1"}


def test_children_get_their_own_argv_env_and_log_and_exit_codes_come_back(tmp_path):
    server = Zygote.start(["tests.runtime._forked_child"], ENV)
    try:
        assert server.usable()
        logs = [tmp_path / f"child{n}.log" for n in range(3)]
        kids = [server.spawn("tests.runtime._forked_child", [code], {**ENV, "FORKED_TEST": f"child{n}"}, str(log))
                for n, (code, log) in enumerate(zip(["0", "3", "wait"], logs))]
        assert len({k.pid for k in kids} | {server.proc.pid}) == 4  # processes of their own
        assert kids[0].wait(30) == 0 and kids[1].wait(30) == 3
        with pytest.raises(subprocess.TimeoutExpired):
            kids[2].wait(0.5)
        assert kids[2].poll() is None
        deadline = time.monotonic() + 30
        while "argv=['wait']" not in logs[2].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(kids[2].pid, signal.SIGKILL)  # a real signal, as chaos sends one
        assert kids[2].wait(30) == -signal.SIGKILL
        for n, (log, argv) in enumerate(zip(logs, ["0", "3", "wait"])):
            text = log.read_text()
            assert f"argv=['{argv}'] env=child{n} stdin=''" in text, text  # stdin: /dev/null, not the pipe
            assert f"pid={kids[n].pid}" in text
    finally:
        server.close()
    assert server.proc.poll() is not None


def test_a_pid_the_kernel_hands_out_again_answers_for_its_new_child(tmp_path):
    """A long-lived server outlives the kernel's pid wrap-around (32768 by default; the test suite's CLI
    server forks hundreds of runs): a child that gets a reaped child's pid reports its own exit, not the
    earlier one's. ns_last_pid (root) steers the server's next fork to the reaped pid."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if not os.access(last_pid, os.W_OK):
        pytest.skip("steering a fork to a given pid needs a writable /proc/sys/kernel/ns_last_pid (root)")
    server = Zygote.start(["tests.runtime._forked_child"], ENV)
    try:
        assert server.usable()
        first = server.spawn("tests.runtime._forked_child", ["3"], ENV, str(tmp_path / "first.log"))
        assert first.wait(30) == 3
        for attempt in range(50):  # another process of the host may fork between the write and the server's
            last_pid.write_text(str(first.pid - 1))
            second = server.spawn("tests.runtime._forked_child", ["wait"], ENV, str(tmp_path / f"second{attempt}.log"))
            if second.pid == first.pid:
                break
            second.kill()
            second.wait(30)
        assert second.pid == first.pid, "no fork landed on the reaped pid in 50 tries"
        assert second.poll() is None  # alive: the reaped child's exit code 3 is not its own
        second.kill()  # a real signal: not skipped as "already exited"
        assert second.wait(30) == -signal.SIGKILL
        assert first.wait(0) == 3
    finally:
        server.close()


def test_a_server_with_threads_running_does_not_fork(tmp_path):
    module = tmp_path / "threaded_child.py"
    module.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                      "def main(argv):\n    pass\n")
    server = Zygote.start(["threaded_child"], {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV['PYTHONPATH']}"})
    assert not server.usable()
    assert server.proc.poll() is not None  # closed: the launcher execs each trainer instead


def test_a_held_socket_goes_to_the_child_that_keeps_it_and_to_no_other_process(tmp_path):
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    held.listen(8)
    port, fd = held.getsockname()[1], held.fileno()
    server = Zygote.start(["tests.runtime._forked_child"], ENV, hold=(fd,))
    held.close()  # the launcher's copy goes once the server has one (start_coordinator)
    try:
        assert server.usable()
        logs = [tmp_path / "other.log", tmp_path / "keeper.log"]
        other = server.spawn("tests.runtime._forked_child", ["wait"], ENV, str(logs[0]))
        keeper = server.spawn("tests.runtime._forked_child", ["wait"], ENV, str(logs[1]), keep=(fd,))
        deadline = time.monotonic() + 30
        while not all(log.exists() and "argv=['wait']" in log.read_text() for log in logs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert bind(port) == errno.EADDRINUSE  # the keeper holds it
        os.kill(keeper.pid, signal.SIGKILL)
        assert keeper.wait(30) == -signal.SIGKILL
        assert bind(port) == 0  # nobody else had a copy: not the server, not the other child
        assert other.poll() is None
        os.kill(other.pid, signal.SIGKILL)
        assert other.wait(30) == -signal.SIGKILL
    finally:
        server.close()


def test_a_launcher_running_one_thread_forks_the_server_itself(tmp_path):
    """`unbroken train` runs one thread when it starts its server, so it forks the server rather than
    exec a fresh interpreter; the server's children still get their own streams, argv and exit codes."""
    log = tmp_path / "kid.log"
    script = textwrap.dedent(f"""
        import os
        from unbroken.runtime.launcher.zygote import Zygote, _Server, alone
        assert alone()
        server = Zygote.start(["tests.runtime._forked_child"], dict(os.environ))
        assert isinstance(server.proc, _Server) and server.usable()
        with open(f"/proc/{{server.proc.pid}}/cmdline") as f, open("/proc/self/cmdline") as g:
            same = f.read() == g.read()  # a fork's command line is its parent's
        kid = server.spawn("tests.runtime._forked_child", ["3"], {{**os.environ, "FORKED_TEST": "kid"}}, {str(log)!r})
        print(same, kid.pid, kid.wait(30))
        server.close()
        print(server.proc.returncode)
    """)
    r = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stderr[-3000:]
    (same, pid, code), (closed,) = [line.split() for line in r.stdout.splitlines()]
    assert same == "True" and code == "3" and closed == str(-signal.SIGKILL)
    assert f"pid={pid} argv=['3'] env=kid stdin=''" in log.read_text()
