"""The coordination store in etcd: a `torch.distributed.Store` whose keys live in an etcd v3 cluster.

Owns: `EtcdStore` (set/get/add/compare_set/check/wait/multi_get/multi_set/delete_key/num_keys, the calls
the code makes of a TCPStore), failing over
between the cluster's members. Does not own: key names (keys.py), which store a process talks to
(store.connect), or any consensus: every read-modify-write is one etcd transaction (compare on the key's
value, create or mod revision, then put), so etcd's Raft log orders them and a decision made by
compare_set is made once, whichever member served it.

Why a Python subclass of `torch.distributed.Store`: c10d calls Python stores through its trampoline, so
`PrefixStore(prefix, EtcdStore(...))` and everything built on it (coordination, heartbeats, snapshots,
gloo's rendezvous of an epoch group) keep working unchanged. The client is `etcd3gw` (etcd's JSON gateway
over `requests`; pure Python, maintained), installed by the `[etcd]` extra.

What a call costs: one HTTP round trip (add: two, a read and a transaction, more under contention);
`wait` reads, then blocks in an etcd watch from the revision it read, in windows of at most 1 s (a
watch stream cut by a member's death must not hang the waiter until its timeout). A call that reaches no
member for `failover_s` raises torch's DistNetworkError, as a TCPStore client does when its server is
gone; a wait past its timeout raises DistStoreError, as a TCPStore's does.
An ambiguous failure (a request sent, the member gone before its answer) is retried on the next member:
put and compare_set are idempotent under a retry (compare_set then reads the value it wrote). An add is
made so: its transaction also writes this client's add token (one key per client, outside every key of
the protocol, holding the number of the client's latest add), so when a retry of it finds the counter
moved, one read of the token says whether the move was its own write, and it is not counted twice
(counters decide: a snapshot's first and last shard, a step's last publisher).
"""
from __future__ import annotations

import base64
import datetime
import itertools
import secrets
import time
from collections.abc import Callable

from torch.distributed import DistNetworkError, DistStoreError, Store

from unbroken.storeurl import FAILOVER_S, EtcdAddress, parse_url  # noqa: F401  (parse_url: the store's API)

# Every client made in this process, kept referenced: c10d's C++ side (a PrefixStore over it, gloo's
# clone) holds only the pointer, and a Python object collected under it loses its methods ("Not
# implemented"). Clients are few per process (one per thread, one per group), so none is ever freed.
_LIVE: list[Store] = []


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class EtcdStore(Store):
    """One client of the cluster; like a TCPStore client, use one per thread. `timeout_s`: how long
    get/wait wait for a key (set_timeout changes it); `failover_s`: how long a call keeps trying the
    members before it raises DistNetworkError (default: the address's `?failover=`)."""

    def __init__(self, address: EtcdAddress | str, timeout_s: float = 300.0, failover_s: float | None = None):
        super().__init__()
        from etcd3gw.client import Etcd3Client  # the [etcd] extra: imported only where etcd is used
        from etcd3gw import exceptions
        self.address = parse_url(address) if isinstance(address, str) else address
        self._root = f"/unbroken/{self.address.namespace}/".encode()
        self._clients = [Etcd3Client(host=h, port=p, timeout=2, api_path="/v3/") for h, p in self.address.endpoints]
        self._down = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                      exceptions.InternalServerError)
        self._timeouts = (exceptions.WatchTimedOut,)
        self._at = 0  # the member this client talks to; moves on when it stops answering
        self._timeout_s = timeout_s
        self._failover_s = self.address.failover_s if failover_s is None else failover_s
        self._fence: list[dict] = []  # compares every write of this client must pass (fence())
        # this client's add token: b"\x00" starts no key of the protocol, and it lives in the namespace
        # so clearing a namespace clears it
        self._token = _b64(self._root + b"\x00adds/" + secrets.token_hex(8).encode())
        self._adds = itertools.count(1)
        self._failovers = 0  # requests that found their member gone: an answer may have been lost
        self._on_deposed: Callable[[], None] = lambda: None
        _LIVE.append(self)

    def fence(self, key: str, value: str, on_deposed: Callable[[], None]) -> None:
        """From now on every write of this client lands only while `key` holds `value` (the leader's key
        and identity, election.py), in the same transaction: a deposed leader's write is refused by etcd
        itself, whatever its threads were doing, and `on_deposed` runs (it must not return normally:
        the coordinator ends its process)."""
        self._fence = [{"key": _b64(self._key(key)), "target": "VALUE", "result": "EQUAL",
                        "value": _b64(value.encode())}]
        self._on_deposed = on_deposed

    def _fenced(self, compare: list, success: list, failure: list) -> dict:
        """A write transaction under the fence: when only the fence failed, `on_deposed`."""
        if not self._fence:
            return self._txn(compare, success, failure)
        r = self._txn(self._fence + compare, success, failure + [{"request_range": {"key": self._fence[0]["key"]}}])
        if not r.get("succeeded"):
            held = (r["responses"][-1].get("response_range", {}).get("kvs") or [{}])[0].get("value")
            if held != self._fence[0]["value"]:
                self._on_deposed()
                raise DistStoreError("etcd store: this coordinator no longer leads")  # if on_deposed returned
        return r

    # -- one request, failing over between members --------------------------------------------------
    def _post(self, path: str, body: dict) -> dict:
        deadline = time.monotonic() + self._failover_s
        last: Exception | None = None
        while True:
            client = self._clients[self._at]
            try:
                return client.post(client.get_url(path), json=body)
            except self._down as e:  # this member is gone (or lost its leader): try the next
                last = e
                self._failovers += 1
                self._at = (self._at + 1) % len(self._clients)
                if time.monotonic() > deadline:
                    raise DistNetworkError(f"etcd store {self.address.url}: no member answered for "
                                           f"{self._failover_s:.0f} s ({type(last).__name__})") from None
                time.sleep(0.05)

    def _key(self, key: str | bytes) -> bytes:
        return self._root + _bytes(key)

    def _txn(self, compare: list, success: list, failure: list) -> dict:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def _ranges(self, keys: list[str]) -> tuple[list[dict | None], int]:
        """The kv of each key (None: missing) and the store's revision, in one round trip."""
        r = self._txn([], [{"request_range": {"key": _b64(self._key(k))}} for k in keys], [])
        kvs = [(resp.get("response_range", {}).get("kvs") or [None])[0] for resp in r.get("responses", [])]
        return kvs, int(r["header"]["revision"])

    # -- the Store interface ------------------------------------------------------------------------
    def set(self, key, value) -> None:
        self._fenced([], [{"request_put": {"key": _b64(self._key(key)), "value": _b64(_bytes(value))}}], [])

    def multi_set(self, keys, values) -> None:
        self._fenced([], [{"request_put": {"key": _b64(self._key(k)), "value": _b64(_bytes(v))}}
                          for k, v in zip(keys, values)], [])

    def get(self, key) -> bytes:
        self.wait([key])
        kv = self._ranges([key])[0][0]
        return base64.b64decode(kv.get("value", "")) if kv else self.get(key)  # deleted meanwhile: wait again

    def multi_get(self, keys) -> list[bytes]:
        self.wait(list(keys))
        kvs, _ = self._ranges(list(keys))
        return [base64.b64decode(kv.get("value", "")) if kv else b"" for kv in kvs]

    def check(self, keys) -> bool:
        return all(kv is not None for kv in self._ranges(list(keys))[0])

    def add(self, key, amount: int) -> int:
        """The counter after adding `amount` (a missing key counts 0), as TCPStore's: a read, then a
        transaction that writes only if the key did not change since (else read again), once even when
        its answer was lost and it was retried (the module's docstring says how)."""
        k = _b64(self._key(key))
        n = _b64(str(next(self._adds)).encode())  # this call's number, written with it
        while True:
            kv = self._ranges([key])[0][0]
            now = int(base64.b64decode(kv.get("value", "")) or b"0") if kv else 0
            guard = ({"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]} if kv
                     else {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            if amount == 0:
                return now
            failovers = self._failovers
            if self._fenced([guard], [{"request_put": {"key": k, "value": _b64(str(now + amount).encode())}},
                                      {"request_put": {"key": self._token, "value": n}}], []).get("succeeded"):
                return now + amount
            if self._failovers != failovers and self._landed(n):  # our first try went through unanswered
                return now + amount

    def _landed(self, n: str) -> bool:
        """Whether this client's add token holds `n`: that add's transaction was applied."""
        r = self._post("/kv/range", {"key": self._token})
        return any(kv.get("value") == n for kv in r.get("kvs") or [])

    def compare_set(self, key, expected, desired) -> bytes:
        """TCPStore's semantics: writes `desired` if the key holds `expected` (or is missing and `expected`
        is empty) and returns it; else returns the value held (`expected` when the key is missing)."""
        k, expected, desired = _b64(self._key(key)), _bytes(expected), _bytes(desired)
        guard = ({"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"} if not expected
                 else {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)})
        r = self._fenced([guard], [{"request_put": {"key": k, "value": _b64(desired)}}],
                         [{"request_range": {"key": k}}])
        if r.get("succeeded"):
            return desired
        kvs = r["responses"][0].get("response_range", {}).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else expected

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        keys = list(keys)
        while True:
            kvs, revision = self._ranges(keys)
            missing = [k for k, kv in zip(keys, kvs) if kv is None]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"etcd store: wait timeout after {seconds:.0f} s for {missing[0]!r}")
            client = self._clients[self._at]
            try:  # blocks until the key is put after `revision`, or the window ends: then look again
                client.watch_once(self._key(missing[0]), timeout=min(left, 1.0), start_revision=revision + 1,
                                  filters=["NODELETE"])
            except self._timeouts:
                pass
            except self._down:
                self._at = (self._at + 1) % len(self._clients)

    def delete_key(self, key) -> bool:
        r = self._fenced([], [{"request_delete_range": {"key": _b64(self._key(key))}}], [])
        return int(r["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        end = self._root[:-1] + bytes([self._root[-1] + 1])
        r = self._post("/kv/range", {"key": _b64(self._root), "range_end": _b64(end), "count_only": True})
        return int(r.get("count", 0))

    # the names c10d's trampoline calls from C++ (PrefixStore, gloo's rendezvous)
    getNumKeys = num_keys
    deleteKey = delete_key

    def clone(self) -> EtcdStore:
        """A new client of the same store (gloo takes one per process group)."""
        return EtcdStore(self.address, self._timeout_s, self._failover_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout_s)

    def status(self) -> list[dict]:
        """Each member's status as it answers (or {"endpoint", "error"}): for checks and operators."""
        out = []
        for (h, p), c in zip(self.address.endpoints, self._clients):
            try:
                out.append({"endpoint": f"{h}:{p}", **c.status()})
            except self._down as e:
                out.append({"endpoint": f"{h}:{p}", "error": type(e).__name__})
        return out
