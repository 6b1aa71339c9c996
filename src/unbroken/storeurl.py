"""The address of an etcd coordination store: `etcd://h1:2379,h2:2379[/namespace][?failover=S]`.

Owns: parsing and printing that address (`EtcdAddress`, `parse_url`, `problem`). Torch-free, so the
config's validation and the store's client (runtime/store/etcd.py) read it through one parser.
Does not own: talking to etcd, or whether the members answer (store.preflight checks that when a run
starts).
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

SCHEME = "etcd://"
FAILOVER_S = 15.0  # default: how long a call keeps trying the members (an etcd leader election takes ~1-10 s)
SHAPE = "etcd://host:2379[,host:2379...][/namespace][?failover=S]"


@dataclass(frozen=True)
class EtcdAddress:
    endpoints: tuple[tuple[str, int], ...]
    namespace: str  # every key lives under /unbroken/{namespace}/
    failover_s: float = FAILOVER_S  # `?failover=S`: how long each client keeps trying before the store is lost

    @property
    def url(self) -> str:
        tail = "" if self.failover_s == FAILOVER_S else f"?failover={self.failover_s:g}"
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints) + f"/{self.namespace}{tail}"


def _parse(url: str) -> EtcdAddress | str:
    """The address, or why `url` is not one (a phrase naming the bad part)."""
    if not url.startswith(SCHEME):
        return f"an etcd store looks like {SHAPE}"
    rest, _, query = url[len(SCHEME):].partition("?")
    failover = FAILOVER_S
    if query:
        name, _, value = query.partition("=")
        try:
            failover = float(value) if name == "failover" else -1.0
        except ValueError:
            failover = -1.0
        if not 0 < failover < 3600:
            return f"bad option {query!r} (the one option is failover=S, 0 < S < 3600 seconds)"
    hosts, _, namespace = rest.partition("/")
    endpoints = []
    for part in hosts.split(","):
        parsed = urlparse(f"//{part}")
        try:
            port = parsed.port if parsed.port is not None else 2379
        except ValueError:  # not a number, or out of 0-65535
            return f"bad member {part!r} (host:port)"
        if not parsed.hostname or not 0 < port < 65536:
            return f"bad member {part!r} (host:port)"
        endpoints.append((parsed.hostname, port))
    namespace = namespace.strip("/") or "default"
    if not all(c.isalnum() or c in "-_." for c in namespace):
        return f"namespace {namespace!r} may hold letters, digits, '-', '_' and '.' only"
    return EtcdAddress(tuple(endpoints), namespace, failover)


def parse_url(url: str) -> EtcdAddress:
    """Parse `etcd://h1:2379,h2:2379[/namespace][?failover=S]` (namespace default "default"; S seconds,
    default 15, that every client of the run keeps trying the members before it gives the store up as
    lost: a cluster that re-elects its leader slower than that ends the run). Call wherever a store URL
    is used; raises ValueError naming the URL and its bad part."""
    got = _parse(url)
    if isinstance(got, str):
        raise ValueError(f"{url!r}: {got}")
    return got


def problem(url: str) -> str | None:
    """Why `url` is not a store address, one phrase naming the bad part; None if it is one, or empty (the
    coordinator's own store). Syntax only: for config validation, which must not touch the network."""
    if not url:
        return None
    got = _parse(url)
    return got if isinstance(got, str) else None
