"""EtcdStore against a real 3-member etcd cluster: the Store calls the code makes, with TCPStore's meaning.

What must hold for the coordination protocol: compare_set decides once (concurrent proposers from
processes of their own: exactly one wins, and everyone reads the winner), add counts every increment
from concurrent clients, get/wait block until the key appears and time out with DistStoreError, a
PrefixStore over it and a gloo group formed on it work, and a member SIGKILLed is failed over.
"""
from __future__ import annotations

import base64
import datetime
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch.distributed as dist

from unbroken.runtime.store.etcd import EtcdStore, parse_url

pytestmark = pytest.mark.timeout(90)


def fresh(url: str) -> EtcdStore:
    return EtcdStore(f"{url}/t-{uuid.uuid4().hex[:8]}", timeout_s=10)


def test_the_store_calls_mean_what_they_mean_on_a_tcpstore(etcd):
    s = fresh(etcd)
    assert s.num_keys() == 0 and not s.check(["a"])
    s.set("a", "1")
    assert s.get("a") == b"1" and s.check(["a"]) and not s.check(["a", "b"])
    assert [s.add("n", 2), s.add("n", 3), s.add("n", 0)] == [2, 5, 5] and s.get("n") == b"5"
    assert s.compare_set("cs", "", "x") == b"x"  # missing + expected empty: written
    assert s.compare_set("cs", "y", "z") == b"x"  # mismatch: the value held, nothing written
    assert s.compare_set("cs", "x", "z") == b"z" and s.get("cs") == b"z"
    assert s.compare_set("none", "\x00m", "\x00m") == b"\x00m" and not s.check(["none"])  # store.read's probe
    s.multi_set(["m1", "m2"], ["p", "q"])
    assert s.multi_get(["m1", "m2"]) == [b"p", b"q"]
    p = dist.PrefixStore("g0", s)
    p.set("k", "v")
    assert p.get("k") == b"v" and p.add("c", 4) == 4 and p.compare_set("k", "v", "w") == b"w"
    assert s.delete_key("a") and not s.check(["a"]) and s.num_keys() > 0
    threading.Timer(0.3, lambda: EtcdStore(s.address).set("later", "1")).start()
    t0 = time.monotonic()
    assert s.get("later") == b"1" and time.monotonic() - t0 < 3  # blocked until it was set
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], datetime.timedelta(seconds=0.5))


def test_compare_set_decides_once_and_add_counts_every_increment_across_processes(etcd):
    url = fresh(etcd).address.url
    code = ("import sys; from unbroken.runtime.store.etcd import EtcdStore\n"
            "s = EtcdStore(sys.argv[1]); me = sys.argv[2]\n"
            "won = s.compare_set('decision', '', 'commit@' + me)\n"
            "for _ in range(20): s.add('count', 1)\n"
            "print(won.decode())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    seen = [p.communicate(timeout=60)[0].strip() for p in procs]
    s = EtcdStore(url)
    assert all(p.returncode == 0 for p in procs)
    assert len(set(seen)) == 1 and seen[0] == s.get("decision").decode()  # one decision, read by all
    assert int(s.get("count")) == 80


def test_a_gloo_group_forms_on_a_prefix_of_it(etcd):
    url = fresh(etcd).address.url
    code = ("import sys, datetime, torch, torch.distributed as dist\n"
            "from unbroken.runtime.store.etcd import EtcdStore\n"
            "r = int(sys.argv[2])\n"
            "pg = dist.ProcessGroupGloo(dist.PrefixStore('epoch0', EtcdStore(sys.argv[1])), r, 2,"
            " datetime.timedelta(seconds=30))\n"
            "t = torch.tensor([r + 1.0]); pg.allreduce([t]).wait(); print(t.item())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    assert [p.communicate(timeout=60)[0].strip() for p in procs] == ["3.0", "3.0"]


def test_a_killed_member_is_failed_over(tmp_path):
    from tests.etcd_cluster import etcd_binary, start
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server; .ci/run installs it)")
    cluster = start(tmp_path / "etcd", 3)
    try:
        s = EtcdStore(cluster.url + "/failover", timeout_s=10)
        s.set("before", "1")
        cluster.kill(0)  # the member this client talks to first
        assert cluster.procs[0].poll() is not None
        t0 = time.monotonic()
        s.set("after", "2")
        assert s.get("after") == b"2" and s.get("before") == b"1" and s.add("n", 1) == 1
        assert time.monotonic() - t0 < 10
        assert s._at != 0  # it moved to another member
    finally:
        cluster.stop()


def test_urls_are_parsed_or_refused_naming_the_bad_part():
    a = parse_url("etcd://h1:2379,h2:2380/job-7")
    assert a.endpoints == (("h1", 2379), ("h2", 2380)) and a.namespace == "job-7"
    assert parse_url("etcd://h1").endpoints == (("h1", 2379),) and parse_url("etcd://h1").namespace == "default"
    assert a.failover_s == 15.0 and a.url == "etcd://h1:2379,h2:2380/job-7"
    b = parse_url("etcd://h1/job-7?failover=2.5")  # every client of the run gives the store up after 2.5 s
    assert (b.namespace, b.failover_s, parse_url(b.url)) == ("job-7", 2.5, b)
    for bad, part in (("etcd://h1:x", "'h1:x'"), ("http://h1", "etcd://"), ("etcd://h1/a b", "'a b'"),
                      ("etcd://h1/j?failover=0", "'failover=0'"), ("etcd://h1/j?ttl=3", "'ttl=3'"),
                      ("etcd://h1/j?failover=x", "'failover=x'")):
        with pytest.raises(ValueError, match=part):
            parse_url(bad)


def test_one_leader_at_a_time_and_a_leader_that_lost_its_lease_ends(etcd):
    from unbroken.runtime.coordinator.election import Leadership
    url = fresh(etcd).address.url
    lost = threading.Event()
    first = Leadership(EtcdStore(url), "first", ttl_s=2, on_lost=lost.set)
    assert first.acquire() < 1.0 and first.holder() == "first"
    second = Leadership(EtcdStore(url), "second", ttl_s=2, on_lost=lambda: None)  # (default: end the process)
    got = []
    t = threading.Thread(target=lambda: got.append(second.acquire()), daemon=True)
    t.start()
    time.sleep(1.5)
    assert not got and second.holder() == "first"  # the first keeps its lease alive: the second waits
    EtcdStore(url)._post("/kv/lease/revoke", {"ID": first.lease})  # as if its TTL had passed unrefreshed
    t.join(timeout=5)
    assert got and second.holder() == "second"  # the vacancy was taken ...
    assert lost.wait(timeout=3)  # ... and the first found out at its next keep-alive (its process would end)
    second.resign()
    assert second.holder() is None


def test_a_deposed_leader_cannot_write(etcd):
    from unbroken.runtime.store import keys
    from unbroken.runtime.coordinator.election import Leadership
    url = fresh(etcd).address.url
    deposed = threading.Event()
    first_store = EtcdStore(url)
    first = Leadership(first_store, "first", ttl_s=2, on_lost=lambda: None)  # its keep-alive stays quiet
    first.acquire()
    first_store.fence(keys.leader(), "first", deposed.set)
    first_store.set("epoch", "1")  # while it leads, writes land
    assert first_store.compare_set("epoch", "1", "2") == b"2" and first_store.add("n", 1) == 1
    EtcdStore(url)._post("/kv/lease/revoke", {"ID": first.lease})  # stalled past its TTL ...
    second = Leadership(EtcdStore(url), "second", ttl_s=2, on_lost=lambda: None)
    second.acquire()  # ... and a standby leads
    for write in (lambda: first_store.set("epoch", "9"), lambda: first_store.compare_set("epoch", "2", "9"),
                  lambda: first_store.add("n", 1), lambda: first_store.multi_set(["epoch"], ["9"])):
        deposed.clear()
        with pytest.raises(dist.DistStoreError, match="no longer leads"):
            write()
        assert deposed.is_set()
    s = EtcdStore(url)
    assert s.get("epoch") == b"2" and s.get("n") == b"1"  # none of the deposed leader's writes landed
    second.resign()


def test_an_add_whose_answer_was_lost_counts_once(etcd):
    """A member applies an add's transaction and is gone before it answers: the retry on the next member
    finds the counter moved, and must not count it again (counters decide a snapshot's commit and a
    step's last publisher)."""
    from etcd3gw import exceptions
    s = fresh(etcd)
    assert s.add("n", 1) == 1
    client = s._clients[s._at]
    real, lost = client.post, []
    counter = base64.b64encode(s._key("n")).decode()

    def post(url, json=None, **kw):
        answer = real(url, json=json, **kw)
        writes = [op["request_put"]["key"] for op in (json or {}).get("success", []) if "request_put" in op]
        if url.endswith("/kv/txn") and counter in writes and not lost:  # applied; the answer never comes
            lost.append(answer)
            raise exceptions.ConnectionFailedError("the member died before it answered")
        return answer
    client.post = post
    assert s.add("n", 1) == 2 and lost  # the first try was applied, the retry went to the next member
    assert EtcdStore(s.address).add("n", 0) == 2  # counted once
    assert s.add("n", 5) == 7  # and the client counts on
