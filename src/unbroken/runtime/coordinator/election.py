"""Which of several coordinators leads a run: an etcd lease, held by a key only one can create.

Owns: `Leadership` (acquire: block until this process holds `keys.leader()` under a lease of its own;
keep the lease alive from a thread; end the process the moment the lease is lost), and `lead` (that,
plus fencing every write of the leader's store client). Does not own: what a
leader does (coordinator.py), the store (store/etcd.py), or any consensus: the key is created by one etcd
transaction ("create if absent", attached to the lease), and etcd deletes it when the lease's TTL passes
without a keep-alive, so a SIGKILLed, hung or partitioned leader loses it after at most the TTL.

What the TTL trades: a standby takes over within TTL + one poll (0.25 s) of the leader's death, and a
leader that cannot reach etcd for a whole TTL (a long GC pause, a partition) is replaced. Fencing: the
keep-alive thread ends the process (os._exit) when a refresh finds the lease gone, and every write of the
leader's store client carries, in the same etcd transaction, the condition that the leader key still holds
its identity (EtcdStore.fence): a leader that stalled past its TTL and wakes up cannot write an epoch, a
verdict or anything else, whichever of its threads runs first; its first write ends it instead.
"""
from __future__ import annotations

import base64
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from unbroken.runtime.store import keys
from unbroken.runtime.store.etcd import EtcdStore

POLL_S = 0.25  # a standby looks for a vacant leadership this often


class Leadership:
    """Call `acquire()` once (blocks until this process leads), then lead; the lease is refreshed every
    TTL/3 by a daemon thread, and `on_lost` (default: os._exit(3)) runs if it lapses anyway."""

    def __init__(self, store: EtcdStore, me: str, ttl_s: int, on_lost: Callable[[], None] | None = None):
        if ttl_s < 1:
            raise ValueError(f"lease TTL {ttl_s} s: etcd leases last whole seconds, at least 1")
        self.store, self.me, self.ttl_s = store, me, ttl_s
        self.on_lost = on_lost or (lambda: os._exit(3))
        self.lease: str | None = None
        self.previous: str | None = None  # the last other holder acquire() saw (who this one took over from)
        self._resigned = threading.Event()  # stops the keep-alive: a lapse after resign() is not a loss
        self._key = base64.b64encode(store._key(keys.leader())).decode()

    def holder(self) -> str | None:
        """Who leads now (None: nobody: the last leader's lease lapsed)."""
        kv = self.store._ranges([keys.leader()])[0][0]
        return base64.b64decode(kv["value"]).decode() if kv else None

    def acquire(self) -> float:
        """Block until this process leads; returns the seconds it waited."""
        t0 = time.monotonic()
        while True:
            lease = self.store._post("/lease/grant", {"TTL": self.ttl_s})["ID"]
            won = self.store._txn(
                [{"key": self._key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                [{"request_put": {"key": self._key, "value": base64.b64encode(self.me.encode()).decode(),
                                  "lease": lease}}], []).get("succeeded")
            if won:
                self.lease = lease
                threading.Thread(target=self._keep_alive, name="lease", daemon=True).start()
                return time.monotonic() - t0
            self.store._post("/kv/lease/revoke", {"ID": lease})
            while (held := self.holder()) is not None:
                self.previous = held
                time.sleep(POLL_S)

    def _keep_alive(self) -> None:
        # a client of its own: store clients are not shared between threads
        store = EtcdStore(self.store.address, failover_s=self.ttl_s)
        expires = time.monotonic() + self.ttl_s
        while not self._resigned.wait(self.ttl_s / 3):
            try:
                ttl = int(store._post("/lease/keepalive", {"ID": self.lease}).get("result", {}).get("TTL", -1))
            except Exception:  # noqa: BLE001 - no member answered: the lease may still be alive, try again
                ttl = 0 if time.monotonic() > expires else None
            if ttl is not None and ttl <= 0:  # lapsed: another coordinator may lead now
                self.on_lost()
                return
            if ttl:
                expires = time.monotonic() + ttl

    def resign(self) -> None:
        """Give the leadership up at once (a clean end): a standby need not wait for the TTL."""
        self._resigned.set()
        if self.lease is not None:
            self.store._post("/kv/lease/revoke", {"ID": self.lease})


def lead(store: EtcdStore, ttl_s: int, on_deposed: Callable[[], None]) -> tuple[Leadership, float]:
    """Block until this process leads the run whose state is in `store`; returns (the leadership, the
    seconds it waited). From then on every write of `store` lands only while this process leads, and a
    write that finds another leader calls `on_deposed`, which must end the process. Call once, on the
    client the coordinator writes with, before any write of its own."""
    # host, pid and a random tag: coordinators on different hosts may share a pid, and the fence
    # compares this identity, so it must be one process's alone
    me = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(3)}"
    leadership = Leadership(store, me, ttl_s)
    waited = leadership.acquire()
    store.fence(keys.leader(), me, on_deposed)
    return leadership, waited
