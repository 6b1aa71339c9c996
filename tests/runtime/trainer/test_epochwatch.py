"""The store watches: epochs, wake-ups and weights by numbered keys, also after timed-out waits; and decisions.

Runs in a subprocess that leaves with os._exit, as workers do: the watch's daemon thread blocks in a
C++ store wait that interpreter shutdown would abort."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = r'''
import datetime, os, time
import unbroken.runtime.store.watch as ew
from unbroken.runtime.store import keys
from torch.distributed import TCPStore, PrefixStore
ew._WAIT = datetime.timedelta(seconds=0.3)  # a day in production
srv = TCPStore("127.0.0.1", 0, 1, True)
s = PrefixStore("g0/", srv)
s.set("epoch", "0")
connect = lambda: PrefixStore("g0/", TCPStore("127.0.0.1", srv.port, 1, False))
w = ew.EpochWatch(connect(), reconnect=connect)
time.sleep(1.0)  # timed-out waits, each followed by a fresh client
s.set("epoch", "1"); s.set(keys.epoch_begun(1), "1")
print("first", w.wait_until(lambda: w.current == 1, 5.0), w.current, flush=True)
s.set("epoch", "3"); s.set(keys.epoch_begun(2), "1"); s.set(keys.epoch_begun(3), "1")  # a burst: 2 and 3
print("burst", w.wait_until(lambda: w.current == 3, 5.0), w.current, flush=True)
os._exit(0)
'''


def test_watch_wakes_on_each_new_epoch_and_after_timed_out_waits():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["first", "True", "1", "burst", "True", "3"]


COUNTERS = r'''
import os
import unbroken.runtime.store.watch as ew
from unbroken.runtime.store import keys
from torch.distributed import TCPStore
srv = TCPStore("127.0.0.1", 0, 1, True)
connect = lambda: TCPStore("127.0.0.1", srv.port, 1, False)
wakes, weights = ew.WakeWatch(connect(), reconnect=connect), ew.WeightsWatch(connect(), reconnect=connect)
print("start", wakes.current, weights.current, flush=True)
ew.wake(srv); ew.wake(srv)
print("woken", wakes.wait_until(lambda: wakes.current == 2, 5.0), flush=True)
ew.publish_weights(srv, '{"1": 0.5}')
print("weights", weights.wait_until(lambda: weights.current == 1, 5.0), srv.get("weights").decode(), flush=True)
os._exit(0)
'''


def test_wake_and_weights_watches_move_on_each_call():
    """The launcher's wake-ups reach the coordinator's loop and new quota weights reach the members'
    sidecars through the same numbered-key watch, without polling."""
    r = subprocess.run([sys.executable, "-c", COUNTERS], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["start", "0", "0", "woken", "True", "weights", "True", '{"1":', '0.5}']


DECISIONS = r'''
import os, time
import unbroken.runtime.store.watch as ew
from unbroken.runtime.store import keys
from torch.distributed import TCPStore
from unbroken.runtime.trainer.membership import Coordination, Plan
srv = TCPStore("127.0.0.1", 0, 1, True)
connect = lambda: TCPStore("127.0.0.1", srv.port, 1, False)
srv.set("epoch", "0"); srv.set("members/0", "[0, 1]"); srv.set("members/1", "[0]")
watch = ew.EpochWatch(connect(), reconnect=connect)
me = Coordination(connect(), 0, watch, decisions=ew.DecisionWatch(connect(), watch.cond, reconnect=connect))
peer = Coordination(connect(), 1)
# a decision written while we wait is pushed to us
me.watch_decision(3, 0)
peer.propose(3, 0, "commit", Plan(0, (0, 1), {1: 0.5}))
kind, d = me.wait_for(3, 0, True, 5.0)  # the commit names its proposer and carries step 4's plan
print("decided", kind, d.outcome, d.proposer, d.plan == Plan(0, (0, 1), {1: 0.5}), flush=True)
# the epoch moves before any decision: we learn that, propose retry ourselves, and the watch's
# thread (blocked on decision/4/0 until our own compare-and-set) goes on to the next decision
srv.set("epoch", "1"); srv.set(keys.epoch_begun(1), "1")
kind, chain = me.wait_for(4, 0, True, 5.0)
print("moved", kind, chain, me.propose(4, 0, "retry").outcome, flush=True)
t = time.monotonic()
me.propose(4, 1, "commit", Plan(1, (0,), {}))
kind, d = me.wait_for(4, 1, True, 5.0)
print("next", kind, d.outcome, d.proposer, d.plan.members, flush=True)
# nothing happens: a TimeoutError after the timeout, not a hang
try:
    me.wait_for(5, 1, True, 0.5)
except TimeoutError:
    print("timeout", round(time.monotonic() - t) < 3, flush=True)
os._exit(0)
'''


def test_decision_watch_pushes_decisions_and_epoch_changes_without_polling():
    r = subprocess.run([sys.executable, "-c", DECISIONS], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["decided", "decided", "commit", "1", "True", "moved", "moved", "((1,", "(0,)),)",
                                "retry", "next", "decided", "commit", "0", "(0,)", "timeout", "True"]


SPURIOUS = r'''
import os, time
import unbroken.runtime.store.watch as ew
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect, last_committed
from torch.distributed import TCPStore
srv = TCPStore("127.0.0.1", 0, 1, True, use_libuv=True)
address = f"127.0.0.1:{srv.port}"
srv.set("epoch", "1"); srv.set("members/1", "[0]"); srv.set(keys.last_commit(), "2")
watch = ew.EpochWatch(connect(address))
decisions = ew.DecisionWatch(connect(address), watch.cond)
decisions.watch(3, 1)
time.sleep(0.3)  # the watch's thread waits on decision/3/1 now
# the launcher's verdict on a lost replica reads the decisions of the step in flight, still missing:
# a compare-and-set that wakes our wait although no decision was written
print("last", last_committed(connect(address)), flush=True)
time.sleep(0.3)
print("spurious", decisions.outcome(3, 1), flush=True)
srv.set(keys.decision(3, 1), "retry:0")
print("real", watch.wait_until(lambda: decisions.outcome(3, 1) is not None, 5.0), decisions.outcome(3, 1), flush=True)
os._exit(0)
'''


def test_decision_watch_waits_again_when_a_read_of_the_missing_key_wakes_it():
    """A compare-and-set of a missing key (store.read, as the launcher's last_committed does) wakes the
    key's waiters on the TCPStore server: the watch must not take that for a decision (it once handed
    "\\x00" to Decision.loads, and the survivors of a lost replica failed under restart-memory)."""
    r = subprocess.run([sys.executable, "-c", SPURIOUS], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["last", "2", "spurious", "None", "real", "True", "retry:0"]


PROBED = r'''
import datetime, os, threading, time
import unbroken.runtime.store.watch as ew
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import read
from torch.distributed import TCPStore
srv = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), use_libuv=True)
client = lambda: TCPStore("127.0.0.1", srv.port, 1, False, timeout=datetime.timedelta(seconds=20), use_libuv=True)
got = {}
def start():  # a worker of a resumed generation: its coordinator has not written `epoch` yet
    try:
        got["epoch"] = ew.EpochWatch(client()).current
    except Exception as e:
        got["epoch"] = repr(e)
t = threading.Thread(target=start)
t.start()
launcher = client()
for _ in range(20):  # the launcher's verdict loop probes `epoch` meanwhile (store.read: a compare_set)
    time.sleep(0.02)
    print("probe", read(launcher, keys.epoch()), flush=True)
srv.set(keys.epoch(), "7")  # the coordinator writes it
t.join(10)
print("epoch", got.get("epoch"), flush=True)
os._exit(0)
'''


def test_a_watch_started_before_the_epoch_is_written_waits_through_the_launcher_s_probes():
    """A libuv TCPStore `get` blocked on a missing key returns b"" when another client probes the key;
    a resumed generation's worker died on int(b"") that way (CI, test_resume_e2e[tcp]). The watch must
    wait for the write instead (store.get_written)."""
    r = subprocess.run([sys.executable, "-c", PROBED], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split("\n")
    assert lines.count("probe None") == 20  # the probes ran while the key was missing
    assert "epoch 7" in lines, r.stdout[-1000:]
