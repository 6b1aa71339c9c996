"""Every committed step gets one record: written by the proposer of its commit, or by one survivor
when that writer died with it unwritten (a real TCPStore; members are Coordination views of it, as in
a worker)."""
from __future__ import annotations

import json

import pytest
from torch.distributed import TCPStore

from unbroken.events import EventLog, read_events
from unbroken.runtime.coordination import Coordination
from unbroken.runtime.sidecar import Sidecar

pytestmark = pytest.mark.timeout(60)

MEMBERS = (0, 1, 2)


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, 1, True)
    server.set("weights", "{}")
    for m in MEMBERS:  # each member's done record of step 5, epoch 0: the step record's owners
        server.set(f"done/5/0/{m}", json.dumps({"held": [m], "timings": [[10, 100, 0.1]]}))
    yield server


def member(store, me, log):
    return Sidecar(Coordination(TCPStore("127.0.0.1", store.port, 1, False), me), log, lambda: f"digest-{me}")


def records(log):
    return [r for r in read_events(log.path) if r["event"] == "step"]


def test_a_survivor_writes_the_record_its_dead_writer_left_unwritten(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    survivors = [member(store, 0, log), member(store, 2, log)]
    for s in survivors:  # member 1 proposed step 5's commit, then died before writing its record
        s.record(5, 0, MEMBERS, 1, {"step": 5, "loss": 1.0})
        s.wait_records()
    assert records(log) == []  # not theirs to write
    for s in survivors:  # both recover in step 6 without member 1: exactly one writes step 5
        s.recover(5, (0, 2))
        s.wait_records()
    (rec,) = records(log)
    assert rec["step"] == 5 and rec["param_digest"] in ("digest-0", "digest-2")
    assert rec["owners"] == {"0": [0], "1": [1], "2": [2]} and rec["members"] == list(MEMBERS)
    assert int(store.get("last_commit")) == 5


def test_no_second_record_when_the_writer_lives_or_already_wrote_it(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    writer, other = member(store, 1, log), member(store, 0, log)
    writer.record(5, 0, MEMBERS, 1, {"step": 5, "loss": 1.0})
    writer.wait_records()
    assert int(store.get("last_commit")) == 5
    other.record(5, 0, MEMBERS, 1, {"step": 5, "loss": 1.0})
    other.recover(5, (0, 1))  # the writer lives
    other.wait_records()
    other.recover(5, (0, 2))  # the writer is gone, but its record was out
    other.wait_records()
    other.recover(4, (0, 2))  # not the step this member applied last: nothing to do
    other.wait_records()
    assert [r["param_digest"] for r in records(log)] == ["digest-1"]


def test_after_the_last_step_a_survivor_writes_the_record_of_a_writer_declared_dead(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    survivor = member(store, 0, log)  # member 1 proposed the last step's commit, then died
    survivor.record(5, 0, MEMBERS, 1, {"step": 5, "loss": 1.0})
    survivor.finish(5, timeout_s=0.3)  # the writer is not (yet) declared dead: wait, give up
    assert records(log) == [] and not store.check(["last_commit"])
    store.set("dead/1", json.dumps({"epoch": 1, "reason": "process exited with code -9"}))
    survivor.finish(5, timeout_s=5.0)
    assert [r["param_digest"] for r in records(log)] == ["digest-0"]
