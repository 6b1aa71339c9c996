"""A cluster of hosts on one machine, made of Linux namespaces: the harness of tests/cluster/.

Owns: making N hosts (`Cluster.make`), each a network namespace (its own loopback and one address on a
private /24, `eth0`) holding a PID, IPC and mount namespace whose first process is the host's init (its
own `/dev/shm` and `/tmp` as fresh tmpfs; the run directory bound back in, as a shared file system), all
joined by veth pairs to one Linux bridge that lives in a namespace of its own (the switch): nothing of it
is in the machine's own namespace, there is no route out, and nothing is ever sent outside it. Running a
command on a host (`Host.popen`, `Host.run`), and the faults of a host and its network: losing a host
(its init killed: every process of its PID namespace and its tmpfs memory go, its link goes down),
cutting its link (`cut`/`mend`: its processes keep running), cutting two hosts apart (blackhole routes
inside both), and a rate on a host's link (`tbf` both ways).
Does not own: what runs on the hosts (the tests) nor judging it.

Names carry a per-run tag (`ub71<hex>`), so pytest-xdist workers side by side never share one; `sweep()`
removes any namespace of an earlier run whose owner is gone, and `Cluster.close` removes this run's however
the test ends. Needs root: `why_not()` says in one line why the cluster cannot be made here.
"""
from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "ub71"  # every namespace this harness makes starts with it (sweep removes stale ones)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One iproute2 / util-linux command, output captured; raises with its stderr where `check`."""
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def why_not() -> str | None:
    """None where namespaces can be made here, else one line saying why not."""
    if os.geteuid() != 0:
        return "tests/cluster needs root (network, PID, IPC and mount namespaces); not root here"
    for tool in ("ip", "unshare", "nsenter", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"tests/cluster needs `{tool}` (iproute2, util-linux)"
    return None


def sweep() -> list[str]:
    """Remove the namespaces of earlier runs whose pytest process is gone (a run killed before its
    finalizers): their names end in that process's pid. Returns the names removed."""
    gone = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name.split("-")[1] if name.count("-") >= 2 else ""
        if owner.isdigit() and Path(f"/proc/{owner}").exists():
            continue  # a live run's (another xdist worker's)
        remove_netns(name)
        gone.append(name)
    return gone


# the host's init: a private tmpfs on /dev/shm and on /tmp, the shared run directory bound back in where it
# was (moved from under the new /dev/shm, since the new /tmp hides the old one), then wait to be killed
# the repository and the Python environment every host runs (sys.prefix: the venv; its base install too)
KEPT = tuple(dict.fromkeys(str(Path(p).resolve()) for p in (Path(__file__).resolve().parents[2], sys.prefix,
                                                            sys.base_prefix)))
# Each argument is a directory the host keeps from the machine (the shared run directory, the repository,
# the Python environment), bound back over its private /tmp: a clone or a venv under /tmp (as CI's may be)
# stays visible, while the host's own /tmp and /dev/shm are fresh.
INIT = """set -e
mount --make-rprivate /
mount -t tmpfs -o size=512m tmpfs /dev/shm
n=0
for p in "$@"; do mkdir /dev/shm/.keep$n && mount --bind "$p" /dev/shm/.keep$n; n=$((n+1)); done
mount -t tmpfs -o size=256m tmpfs /tmp
n=0
for p in "$@"; do mkdir -p "$p" && mount --move /dev/shm/.keep$n "$p" && rmdir /dev/shm/.keep$n; n=$((n+1)); done
mount -t proc proc /proc
ip link set lo up
echo ready
exec sleep infinity
"""


def remove_netns(name: str) -> None:
    """Kill every process left in network namespace `name`, then delete it (either may be gone already)."""
    for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    sh("ip", "netns", "del", name, check=False)


@dataclass
class Host:
    index: int
    netns: str
    address: str  # its one address on the cluster's /24
    init: subprocess.Popen = field(repr=False)
    switch: str = field(repr=False)
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def enter(self) -> list[str]:
        """The command prefix that runs a command inside this host (all of its namespaces)."""
        return ["nsenter", "-t", str(self.init.pid), "--net", "--pid", "--ipc", "--mount", "--"]

    def popen(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Start `argv` on this host, its stdout and stderr into `log`. The process dies with the host."""
        p = subprocess.Popen(self.enter() + list(argv), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             env=env, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, argv: list[str], timeout: float = 30, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """Run `argv` on this host to its end (output captured)."""
        return subprocess.run(self.enter() + list(argv), capture_output=True, text=True, timeout=timeout,
                              env=env)

    def alive(self) -> bool:
        return self.init.poll() is None

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.netns, *args, check=check)


class Cluster:
    """N hosts on one bridge. Use as a context manager (or call `close`): everything is removed at exit."""

    def __init__(self, n: int, shared: Path):
        self.tag = f"{PREFIX}{secrets.token_hex(2)}-{os.getpid()}"
        self.subnet = f"10.77.{secrets.randbelow(250) + 1}"  # a /24 that exists only inside these namespaces
        self.switch = f"{self.tag}-sw"
        self.shared = Path(shared)
        self.hosts: list[Host] = []
        self._made: list[str] = []
        try:
            self._make(n)
        except BaseException:
            self.close()
            raise

    def _make(self, n: int) -> None:
        sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ("ip", "netns", "exec", self.switch)
        sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        sh(*sw, "ip", "link", "set", "br0", "up")
        sh(*sw, "ip", "link", "set", "lo", "up")
        for i in range(n):
            name = f"{self.tag}-h{i}"
            sh("ip", "netns", "add", name)
            self._made.append(name)
            # both ends made straight inside their namespaces: nothing appears in the machine's own
            sh("ip", "link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"h{i}", "netns",
               self.switch)
            sh(*sw, "ip", "link", "set", f"h{i}", "master", "br0")
            sh(*sw, "ip", "link", "set", f"h{i}", "up")
            address = f"{self.subnet}.{i + 10}"
            hx = ("ip", "netns", "exec", name)
            sh(*hx, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            sh(*hx, "ip", "link", "set", "eth0", "up")
            init = subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--pid", "--ipc", "--mount",
                                     "--fork", "--kill-child", "--propagation", "private", "sh", "-c", INIT,
                                     "init", str(self.shared), *KEPT],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            line = init.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"host {i} did not start: {line}{init.stderr.read()}")
            # nsenter -t needs the pid of the process inside the namespaces: unshare's forked child
            inner = int(sh("pgrep", "-P", str(init.pid)).stdout.split()[0])
            self.hosts.append(Host(i, name, address, _Pid(inner, init), self.switch))

    # -- faults -----------------------------------------------------------------------------------------

    def lose(self, i: int) -> None:
        """Host i is gone: its init killed (the kernel kills every process of its PID namespace, and its
        tmpfs /dev/shm and /tmp go with the last of them), its link down."""
        h = self.hosts[i]
        h.init.kill()
        self.cut(i)

    def cut(self, i: int) -> None:
        """Host i's link down (at the switch: its own eth0 loses carrier); its processes keep running."""
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", f"h{i}", "down")

    def mend(self, i: int) -> None:
        """Host i's link back up."""
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", f"h{i}", "up")

    def split(self, i: int, j: int) -> None:
        """Hosts i and j cannot reach each other; each still reaches every other host (blackhole routes
        inside both)."""
        a, b = self.hosts[i], self.hosts[j]
        a.ip("ip", "route", "add", "blackhole", f"{b.address}/32")
        b.ip("ip", "route", "add", "blackhole", f"{a.address}/32")

    def join(self, i: int, j: int) -> None:
        """Undo `split(i, j)`."""
        a, b = self.hosts[i], self.hosts[j]
        a.ip("ip", "route", "del", "blackhole", f"{b.address}/32", check=False)
        b.ip("ip", "route", "del", "blackhole", f"{a.address}/32", check=False)

    def rate(self, i: int, mbit: int) -> None:
        """Host i's link limited to `mbit` Mbit/s both ways (tbf on its eth0 and on the switch's end)."""
        # 10 ms of the rate in one burst (1 Gbit/s: 1.25 MB): at least a tick's worth at HZ=100, so the kernel's
        # timer does not cap the rate below `mbit`
        burst = str(max(32, mbit * 10 // 8)) + "kb"
        for where in (("ip", "netns", "exec", self.hosts[i].netns, "tc", "qdisc", "replace", "dev", "eth0"),
                      ("ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"h{i}")):
            sh(*where, "root", "tbf", "rate", f"{mbit}mbit", "burst", burst, "latency", "100ms")

    # -- teardown ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host and remove every namespace (and with them every veth and the bridge)."""
        for h in self.hosts:
            for p in h.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            h.init.kill()
        for name in reversed(self._made):
            remove_netns(name)
        self._made.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pid:
    """A host's init as the harness holds it: the pid inside the namespaces (for nsenter), killed with
    the `unshare` that forked it (which `--kill-child` makes take the child with it)."""

    def __init__(self, pid: int, unshare: subprocess.Popen):
        self.pid, self._unshare = pid, unshare

    def poll(self) -> int | None:
        return self._unshare.poll()

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # the namespace's init: the kernel kills the rest
        except ProcessLookupError:
            pass
        if self._unshare.poll() is None:
            self._unshare.kill()
        self._unshare.wait(timeout=10)


def wait_for(predicate, timeout: float, every: float = 0.1) -> bool:
    """Poll `predicate` until true or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def quoted(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
