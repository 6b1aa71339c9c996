"""Which network interface this host's gloo groups bind: the one that reaches the coordinator.

Owns: finding, before any process group forms, the local address the kernel routes the coordinator's
address from (a UDP `connect`, which sends nothing) and the interface that holds it, and setting
`GLOO_SOCKET_IFNAME` to it (`bind_gloo_interface`). Does not own: the groups themselves
(collectives.py, parallelize.py, persist/healing.py), nor the coordinator's address (trainer/placement.py).

Why: without it gloo advertises the address its host name resolves to, which on many hosts (and in every
container and network namespace that shares the machine's /etc/hosts) is 127.0.0.1 or an address the
host does not hold: each group then connects to its own loopback and the run hangs at the first
cross-group collective. The interface that reaches the coordinator is the cluster's private network by
construction (the coordinator binds it, `--host`), so the peers reach it too. A coordinator on loopback
(one host) and a `GLOO_SOCKET_IFNAME` the user set leave gloo as it is.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import MutableMapping

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def coordinator_host(address: str) -> str:
    """The host of `host:port`, or of an etcd URL's first endpoint (`etcd://h1:p1,h2:p2`)."""
    if "://" in address:
        address = address.split("://", 1)[1].split(",")[0].split("/")[0]
    return address.rpartition(":")[0].strip("[]") or address


def local_address(host: str) -> str:
    """The local IPv4 address the kernel would send to `host` from (no packet is sent). Raises OSError
    where no route reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, None where none does (Linux ioctl)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def bind_gloo_interface(coordinator: str, env: MutableMapping[str, str]) -> str:
    """Set `env["GLOO_SOCKET_IFNAME"]` to the interface that reaches `coordinator` (host:port or etcd URL)
    and return its name; return "" and change nothing where the user set it, the coordinator is on
    loopback, or no interface could be found (gloo's own choice stands). Call once per process, before its
    first gloo group forms: gloo reads the variable at each group's creation."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return ""
    try:
        host = coordinator_host(coordinator)
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return ""
        name = interface_of(local_address(host))
    except (OSError, ValueError):
        return ""
    if name is None or name == "lo":
        return ""
    env["GLOO_SOCKET_IFNAME"] = name
    return name
