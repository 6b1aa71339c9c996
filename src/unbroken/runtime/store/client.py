"""Connecting to the coordinator's store and the reads every process makes of it.

Owns: `connect` (one client per thread: TCPStore clients are not thread-safe), the one-round-trip
`read` of a key that may be missing, `get_written` of one not yet written, `get_json`, and the two
verdict-time reads that the launcher and the coordinator share: `last_committed` and `finished_among`.
Does not own: key names (keys.py) or a member's protocol on the store (trainer/membership.py).
"""
from __future__ import annotations

import datetime
import json
import os
import time

from torch.distributed import Store, TCPStore

from unbroken.runtime.store import keys

_MISSING = "\x00missing"


def connect(address: str | None = None, timeout_s: float = 60.0) -> Store:
    """A client of the run's store: the coordinator's TCPStore at `host:port`, or an etcd cluster at
    `etcd://h1:2379,...[/namespace]` (store/etcd.py); default: env UNBROKEN_STORE. Raises RuntimeError
    without an address, and torch's DistNetworkError when nothing answers in `timeout_s`."""
    address = address or os.environ.get("UNBROKEN_STORE")
    if not address:
        raise RuntimeError("no store address: pass host:port or set UNBROKEN_STORE")
    if address.startswith("etcd://"):
        from unbroken.runtime.store.etcd import EtcdStore
        return EtcdStore(address, timeout_s=timeout_s)
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                    use_libuv=True)


def read(store: Store, key: str) -> bytes | None:
    """The value of `key`, or None when it is missing: one round trip, where check-then-get is two.
    A compare_set against a value no key of ours holds returns that value when the key is missing
    (and writes nothing), the stored value otherwise. It also wakes whoever waits on a missing key
    (torch's libuv TCPStore server wakes a key's waiters on every compare_set of it), so a `wait`
    returning is no proof that the key exists: a waiter that may meet a reader checks what it read
    (epochwatch.DecisionWatch)."""
    value = store.compare_set(key, _MISSING, _MISSING)
    return None if value == _MISSING.encode() else value


def get_written(store: Store, key: str) -> bytes:
    """`store.get(key)` for a key whose value is never empty, blocking until it is written. A TCPStore
    `get` blocked on a missing key returns b"" when another client's `read` probes that key (the probe's
    compare_set wakes its waiters; measured on torch 2.13's libuv server: the get returned b"" 0.5 s in,
    at the probe). A resumed generation's workers met that: one read `epoch` before its coordinator
    wrote it while the launcher probed it, and died on int(b""). So an empty value is waited for again.
    Raises what `get` raises (DistStoreError once the client's timeout passes without a write)."""
    while True:
        value = store.get(key)
        if value:
            return value
        time.sleep(0.005)  # woken by a probe, not a write: the prober polls, so do not spin with it


def get_json(store: Store, key: str, default=None):
    """The JSON value of `key`, or `default` when it is missing (two round trips)."""
    return json.loads(store.get(key)) if store.check([key]) else default


def last_committed(store: Store, default: int = -1) -> int:
    """The last committed step as the store knows it (`default` before any), for verdicts on a run that
    lost every replica, not for the step loop (a read per epoch): the last step whose record is out
    (`last_commit`), or the step after it when a commit of that one stands but its writer died before
    writing its record with nobody left to write it instead. At most one such step: a writer
    publishes the next step only after its record is out."""
    raw = read(store, keys.last_commit())
    last = -1 if raw is None else int(raw)
    for e in range(int(read(store, keys.epoch()) or 0) + 1):
        value = read(store, keys.decision(last + 1, e))
        if value is not None and value.startswith(b"commit"):
            return last + 1
    return default if raw is None else last


def finished_among(store: Store, ids, seen: tuple[int, frozenset[int]]) -> tuple[int, frozenset[int]]:
    """(nfinished, the members of `ids` that finished): one round trip while the count equals the one in
    `seen` (returned as is), plus a check per id when it moved. Start with (0, frozenset())."""
    n = store.add(keys.finished_count(), 0)
    if n == seen[0]:
        return seen
    return n, frozenset(r for r in ids if store.check([keys.finished(r)]))


def answering(address: str, flag: str, timeout_s: float = 5.0) -> Store:
    """A client of the etcd store at `address` once one of its members answered (within `timeout_s`).
    Raises ConfigError, one line starting with `flag` (the option that named the address), when the
    etcd client is not installed or no member answers."""
    from torch.distributed import DistNetworkError

    from unbroken.config import ConfigError
    try:
        from unbroken.runtime.store.etcd import EtcdStore
    except ImportError:
        raise ConfigError(f"{flag}{address!r}: the etcd client is not installed (pip install 'unbroken[etcd]')") from None
    store = EtcdStore(address, timeout_s=timeout_s, failover_s=timeout_s)
    try:
        store.num_keys()
    except DistNetworkError:
        raise ConfigError(f"{flag}{address!r}: no etcd member answers") from None
    return store


def preflight(address: str, run_id: str | None = None, exists: bool = False, config: str | None = None) -> None:
    """Check an etcd store before a run writes anything: a member answers, and its namespace holds no
    other run's keys (`run_id`: the run that may find its own there, as `unbroken resume` does; `config`:
    a standalone coordinator's config, which may find the same run there, still running, and stand by
    for it; `exists`: only that a member answers, for readers such as `unbroken status`). Raises
    ConfigError, one line. A TCPStore address needs no check (the run makes it)."""
    if not address.startswith("etcd://"):
        return
    from unbroken.config import ConfigError
    store = answering(address, "coord.store=")
    n = store.num_keys()
    if not n or exists:
        return
    held = read(store, keys.run_id())
    claimed = read(store, keys.config()) if config is not None else None  # a standalone coordinator's claim
    if config is not None:  # the same config, and the run not over: this coordinator is one more for it
        ours = claimed == config.encode() and read(store, keys.shutdown()) is None
    else:
        ours = held is not None and held.decode() == run_id
    if not ours:
        owner = f"run {held.decode()!r}" if held is not None else "something else"
        if claimed is not None:
            owner += ", which ended" if claimed == config.encode() else " (another config)"
        root = f"/unbroken/{store.address.namespace}/"
        raise ConfigError(f"coord.store={address!r}: the namespace holds {n} keys of {owner}; use another "
                          f"namespace (etcd://.../NAME) or clear it (etcdctl del --prefix {root})")
