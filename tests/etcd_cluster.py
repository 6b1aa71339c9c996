"""A real etcd cluster of N members on loopback ports, for the tests and benchmarks that need one.

Owns: starting `etcd` processes (the distribution's binary, found on PATH) with their data in a given
directory, waiting until the cluster has a leader, killing one member, and stopping them all. Used by
the `etcd` fixture (tests/conftest.py), benchmarks/store_overhead.py, and `.ci/run` (`python -m
tests.etcd_cluster start DIR` prints the URL and leaves the members running; `stop DIR` ends them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class EtcdCluster:
    root: Path
    clients: list[int]  # client port of each member
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.clients)

    def kill(self, member: int) -> None:
        """SIGKILL one member (its data dir stays)."""
        p = self.procs[member]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(root: Path, members: int = 3, timeout_s: float = 30.0) -> EtcdCluster:
    """Start `members` etcd processes under `root` (data dirs, logs); returns once a leader answers
    a write through the gateway. Raises RuntimeError (with the members' log tails) if none does."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("no etcd binary on PATH (apt-get install etcd-server)")
    root.mkdir(parents=True, exist_ok=True)
    ports = _free_ports(2 * members)
    clients, peers = ports[:members], ports[members:]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peers[i]}" for i in range(members))
    cluster = EtcdCluster(root, clients)
    for i in range(members):
        shutil.rmtree(root / f"m{i}", ignore_errors=True)  # a new cluster: no member of an old one
        cmd = [binary, "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
               "--listen-client-urls", f"http://127.0.0.1:{clients[i]}",
               "--advertise-client-urls", f"http://127.0.0.1:{clients[i]}",
               "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
               "--initial-cluster", initial, "--initial-cluster-state", "new",
               "--initial-cluster-token", f"unbroken-{os.getpid()}-{clients[0]}",
               # loopback: short Raft timers, so a lost leader is replaced in about a second
               "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"]
        log = open(root / f"m{i}.log", "ab")
        cluster.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_put_ok(p) for p in clients):
            return cluster
        time.sleep(0.2)
    cluster.stop()
    tails = {i: (root / f"m{i}.log").read_text()[-500:] for i in range(members)}
    raise RuntimeError(f"etcd cluster did not come up in {timeout_s:.0f} s: {tails}")


def _put_ok(port: int) -> bool:
    body = json.dumps({"key": "X2hlYWx0aA==", "value": "MQ=="}).encode()  # _health = 1
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/put", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def main(argv: list[str]) -> int:
    """`start DIR [N]`: start N members (3), print the URL, write DIR/cluster.json; `stop DIR`: end them."""
    what, root = argv[0], Path(argv[1])
    if what == "start":
        c = start(root, int(argv[2]) if len(argv) > 2 else 3)
        (root / "cluster.json").write_text(json.dumps({"url": c.url, "pids": [p.pid for p in c.procs]}))
        print(c.url)
        return 0
    info = json.loads((root / "cluster.json").read_text())
    for pid in info["pids"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
