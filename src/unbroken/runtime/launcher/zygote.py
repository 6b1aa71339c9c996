"""The local launcher's fork server: one process that has imported torch once, forking each trainer (or
each replica group's torchrun agent, whose ranks fork from it in turn: forkrun.py).

Owns: the fork server's process (`python -m unbroken.runtime.launcher.zygote MODULE [MODULE ...]`: it
imports the modules and what a trainer's first step imports, then forks one child per request, each
calling the requested module's `main(argv)` with the environment and log file it was given), its pipe
protocol, and `Forked`, the launcher's handle on a forked process (the part of `subprocess.Popen` the
launcher uses: pid, poll, wait, returncode). Does not own: what a trainer does (the worker), when
trainers start or stop (launch.py).

Why: a trainer's interpreter spends ~2 CPU-s importing torch, DTensor and dynamo (AdamW's first step
imports torch._dynamo) before its first microbatch. With 4 trainers on 2 cores, that was most of a short
run's start-up and of every whole-job restart. Forked from a process that did it once, a trainer starts in
milliseconds. The children are ordinary processes: their own pids, killed with real signals, exit codes
reported as Popen's (negative: the signal). torchrun's workers (replica groups of several ranks, or
`--launch.launcher=torchrun`) are torchrun's own and start as on a cluster; so do `--launch.launcher=direct`.
A group of several ranks under the default launcher is a forked `forkrun` agent: torchrun's own agent,
whose ranks fork from it, so neither the agent nor its ranks import anything.

Forking after `import torch` is safe where no thread has started: the server checks it has one thread
(it never runs an op, so no intra-op pool exists) and refuses to serve otherwise, and the launcher then
starts each trainer as a fresh interpreter. Python's `random` reseeds in each child (os.register_at_fork);
torch's generator does not, and needs not: a trainer seeds it from (seed, step, microbatch).

Held sockets: a file descriptor the server was started with (`--hold=FD`, inherited) is closed in every
child but the one whose request keeps it; the server closes its own copy once that child has it. So the
coordinator, forked too, serves the port the launcher bound and holds (starting.py), and no other process
keeps it open.

The server itself is forked from the launcher where the launcher runs one thread (`unbroken train`: it
imports torch with one OpenMP thread, `forkable_torch`), saving its interpreter's ~1.3 CPU-s of start-up
and torch import in every run; it then imports what the trainers need, which the launcher never does.
Elsewhere (a launcher inside a threaded process: a test's, a notebook's) it is a fresh interpreter.

Protocol (JSON lines): the launcher writes {"module", "argv", "env", "log", "cores", "keep", "err", "mark"}
(module: one of the server's; keep: held descriptors this child takes; err: stderr's own file, if not the
log's; mark: set UNBROKEN_FORKED); the server answers {"pid"} for
each, in order, and {"exit": pid, "code": c} whenever a child ends.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

READY = "ready"


def name_process(name: str) -> None:
    """Name this process for `ps -o comm`, `top` and `pgrep` (Linux's 15-character comm): a forked
    process's command line is its parent's, so that is where `ps` tells them apart."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def alone() -> bool:
    """Whether this process runs one thread (Python's and the OS's count): only then may it fork a
    process that goes on running Python."""
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1


def forkable_torch() -> None:
    """Import torch with one OpenMP thread, so that the process stays `alone` and can fork its server:
    with OMP_NUM_THREADS unset, importing torch starts OpenMP's pool. The environment is put back, so
    every child gets the launcher's as it was. Call before the launcher first imports torch; a no-op
    once torch is imported (the launcher then execs its server)."""
    if "torch" in sys.modules:
        return
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the launcher computes nothing that wants more
    try:
        import torch  # noqa: F401
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


class Forked:
    """A trainer forked by the server. `poll()` and `wait()` read the server's exit reports; the process is
    the server's child, so only it can reap it."""

    def __init__(self, server: Zygote, pid: int, serial: int):
        # serial: which of the server's children this is; the pid alone may name an earlier, reaped one
        self.server, self.pid, self.serial, self.returncode = server, pid, serial, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.serial, timeout=0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As Popen's: a no-op once the child's exit was reported (its pid may be another's by then)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.serial, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked trainer {self.pid}", timeout)
        return self.returncode


class _Server:
    """The server forked from the launcher, seen as the part of `subprocess.Popen` that Zygote uses (stdin,
    stdout, poll, kill, wait)."""

    def __init__(self, pid: int, requests: int, replies: int):
        self.pid, self.returncode = pid, None
        self.stdin, self.stdout = os.fdopen(requests, "wb"), os.fdopen(replies, "rb")

    @classmethod
    def fork(cls, argv: list[str], env: dict[str, str], hold: tuple[int, ...]) -> _Server:
        """Fork the server (the caller must be `alone`): in the child, `serve(argv)` over two pipes."""
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _become_server(argv, env, requests_r, replies_w, hold)  # never returns
        os.close(requests_r)
        os.close(replies_w)
        return cls(pid, requests_w, replies_r)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        return self._reap(0)


def _become_server(argv: list[str], env: dict[str, str], requests: int, replies: int, hold: tuple[int, ...]) -> None:
    """In the launcher's forked child: keep the request and reply pipes (as fds 0 and 1) and the held
    descriptors, close every other descriptor the launcher had, take `env`, and serve; never returns."""
    code = 1
    try:
        os.dup2(requests, 0)
        os.dup2(replies, 1)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        for fd in {int(f) for f in os.listdir("/proc/self/fd")} - {0, 1, 2, *hold}:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already
        # fresh standard streams over fds 0-2, as an exec'd server has (the launcher's may be wrapped);
        # the children print through them to their logs
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=True)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), write_through=True)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [__file__, *argv]
        name_process("ub:forkserver")
        serve(argv)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class Zygote:
    """The launcher's end. `start(module, env)` once per run, early (the server imports while the launcher
    starts the coordinator); `usable()` before the first `spawn()`; `spawn()` per trainer; `close()` at the
    end, after the trainers were killed. Where `usable()` is False (the server did not come up, or found
    threads running), the launcher execs each trainer instead."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lock = threading.Lock()
        # A child's exit is filed under its serial (the order of the server's pid answers), not its pid:
        # the kernel hands a reaped child's pid to a later fork, and a long-lived server outlives a pid
        # wrap-around (32768 pids by default), so a pid's old exit must not answer for its new child. The
        # server reports an exit only after reaping it, and a pid is reused only after that, so each
        # exit report names the child whose pid answer came last.
        self.live: dict[int, int] = {}  # pid -> serial of the child that holds it now
        self.exits: dict[int, int] = {}  # serial -> exit code
        self.spawned = 0
        self.buffer = b""
        self.ready: bool | None = None  # unknown until the server's first line

    @classmethod
    def start(cls, modules: list[str], env: dict[str, str], hold: tuple[int, ...] = ()) -> Zygote:
        """Start the server for `modules` (what its children may run) with `env` (what every child inherits
        until its request's env replaces it: the import-time settings, OMP_NUM_THREADS among them), holding
        the descriptors `hold` for the children that keep them. Does not wait."""
        argv = [*(f"--hold={fd}" for fd in hold), *modules]
        if alone():
            return cls(_Server.fork(argv, env, hold))
        proc = subprocess.Popen([sys.executable, "-m", __name__, *argv],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                pass_fds=hold)
        return cls(proc)

    def usable(self, timeout_s: float = 60.0) -> bool:
        """Whether the server forks trainers: waits (once) up to `timeout_s` for it to finish importing."""
        with self.lock:  # threads may ask at once (the snapshot agents start in parallel): one reads
            if self.ready is None:
                self.ready = self._line(timeout_s) == {"status": READY}
            if not self.ready:
                self.close()
        return self.ready

    def spawn(self, module: str, argv: list[str], env: dict[str, str], log: str,
              cores: list[int] | None = None, keep: tuple[int, ...] = (), err: str | None = None,
              mark: bool = True) -> Forked:
        """Fork one child running `module` (one the server was started with) with `argv`, `env` (whole: it
        replaces the server's), stdout and stderr appended to `log` (stderr to `err` instead, if given),
        pinned to `cores` if given, keeping the held descriptors `keep` (at their numbers). `mark`: the
        child's UNBROKEN_FORKED says "server" (worker_start's `forked`), which its exec'd children then
        inherit; False leaves the environment as `env` has it. Raises OSError if the server died."""
        request = {"module": module, "argv": argv, "env": env, "log": log, "cores": cores, "keep": list(keep),
                   "err": err, "mark": mark}
        with self.lock:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            while True:
                msg = self._line(30.0)
                if msg is None:
                    raise OSError("the fork server stopped answering")
                if "pid" in msg:
                    return Forked(self, msg["pid"], msg["serial"])

    def exit_code(self, serial: int, timeout: float | None) -> int | None:
        """The exit code of the child `serial` (Forked.serial) once the server reported it, waiting up to
        `timeout` s (None: forever). A server gone is taken as every child gone with it (killed: -9)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while serial not in self.exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._line(left) is None:
                    if self.proc.poll() is not None:
                        return self.exits.setdefault(serial, -9)
                    return None
            return self.exits[serial]

    def _line(self, timeout: float | None) -> dict | None:
        """The next message (exit reports are filed as they come), or None after `timeout` s or at EOF."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        msg = json.loads(line)
        if "pid" in msg:
            msg["serial"], self.spawned = self.spawned, self.spawned + 1
            self.live[msg["pid"]] = msg["serial"]
        if "exit" in msg and msg["exit"] in self.live:
            self.exits[self.live.pop(msg["exit"])] = msg["code"]
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _child(request: dict, inherited: list[int]) -> None:
    """In the forked child: become the trainer the request describes; never returns. It stays in the
    launcher's process group, as a Popen child would (a terminal's Ctrl-C reaches it)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it; a trainer not
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if request.get("err") else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # over the server's request pipe
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, null, *inherited} - {0, 1, 2}:  # and its other children's pidfds
            os.close(fd)
        if request.get("cores"):
            os.sched_setaffinity(0, request["cores"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("mark", True):
            os.environ["UNBROKEN_FORKED"] = "server"  # worker_start's `forked`
        sys.argv = [request["module"], *request["argv"]]
        name_process(f"ub:{request['module'].rsplit('.', 1)[-1]}")  # ub:coordinator, ub:worker, ub:forkrun
        result = importlib.import_module(request["module"]).main(request["argv"])  # imported already
        code = result if isinstance(result, int) else 0  # a main that returns its exit code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(argv: list[str]) -> None:
    """The server's loop: fork on each request, report each child's exit; ends when the launcher's end
    of the pipe closes (the launcher ended), leaving its children to end on their own as exec'd ones do.
    `argv`: `--hold=FD` flags, then the modules."""
    held = {int(a.split("=", 1)[1]) for a in argv if a.startswith("--hold=")}
    modules = [a for a in argv if not a.startswith("--hold=")]
    for module in modules:
        importlib.import_module(module)
    import torch._dynamo  # noqa: F401 - what AdamW's first step imports (~0.8 CPU-s), done once here
    # what the imports made is kept out of every collection from now on, here and in each child: a
    # child's collector would otherwise write into every inherited object and copy each page it lies on
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends the launcher, which closes the pipe: ends here
    out = sys.stdout.buffer
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        out.write(json.dumps({"status": "threads running"}).encode() + b"\n")  # forking would be unsafe
        out.flush()
        return
    out.write(json.dumps({"status": READY}).encode() + b"\n")
    out.flush()
    requests, buffer, children = sys.stdin.buffer.fileno(), b"", {}
    while True:
        ready, _, _ = select.select([requests, *children], [], [])
        for fd in ready:
            if fd == requests:
                chunk = os.read(requests, 65536)
                if not chunk:
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    keep = held & set(request.get("keep", ()))
                    pid = os.fork()
                    if pid == 0:
                        _child(request, [requests, *children, *(held - keep)])
                    for fd in keep:  # the child has it now: the port is the child's alone
                        os.close(fd)
                    held -= keep
                    children[os.pidfd_open(pid)] = pid
                    out.write(json.dumps({"pid": pid}).encode() + b"\n")
                    out.flush()
            else:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                out.flush()


if __name__ == "__main__":
    serve(sys.argv[1:])
