"""Every committed step gets one record: written by the proposer of its commit, or by one survivor
when that writer died with it unwritten (a real TCPStore; members are Coordination views of it, as in
a worker)."""
from __future__ import annotations

import gc
import hashlib
import json
import threading
import time
import weakref

import pytest
from torch.distributed import TCPStore

from unbroken.events import EventLog, read_events
from unbroken.runtime.trainer.membership import Coordination, Decision, Plan
from unbroken.runtime.trainer.sidecar import Sidecar

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
    return Sidecar(Coordination(TCPStore("127.0.0.1", store.port, 1, False), me), log)


def applied(s: Sidecar, step: int, writer: int, digests: dict[int, str] | None = None) -> None:
    """What the trainer calls after applying `step` (epoch 0, all MEMBERS): its own shard's digest by
    default, "digest-<member>"."""
    s.record(step, 0, MEMBERS, writer, {"step": step, "loss": 1.0}, digests or {0: f"digest-{s.coord.me}"})


def records(log):
    return [r for r in read_events(log.path) if r["event"] == "step"]


def test_a_survivor_writes_the_record_its_dead_writer_left_unwritten(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    survivors = [member(store, 0, log), member(store, 2, log)]
    for s in survivors:  # member 1 proposed step 5's commit, then died before writing its record
        applied(s, 5, 1)
        s.wait_records()
    assert records(log) == []  # not theirs to write
    for s in survivors:  # both recover in step 6 without member 1: exactly one writes step 5
        s.recover(5, (0, 2))
        s.wait_records()
    (rec,) = records(log)
    assert rec["step"] == 5 and rec["param_digest"] in ("digest-0", "digest-2")
    assert rec["owners"] == {"0": [0], "1": [1], "2": [2]} and rec["members"] == list(MEMBERS)
    assert int(store.get("last_commit")) == 5


def test_a_writer_declared_dead_before_its_record_leaves_it_to_the_survivor(store, tmp_path):
    """Member 1 (a group that lost a rank, its survivor going on shrunk) was slow to write step 5's record
    and was declared dead meanwhile; the survivor that recovers writes it, and the old writer's late
    write is dropped: one record (seen twice in a test under load before)."""
    log = EventLog(tmp_path / "events.jsonl")
    writer, survivor = member(store, 1, log), member(store, 0, log)
    store.set("dead/1", "process exited with code 4")
    applied(survivor, 5, 1)
    survivor.recover(5, (0, 2))
    survivor.wait_records()
    applied(writer, 5, 1)  # its late write
    writer.wait_records()
    (rec,) = records(log)
    assert rec["param_digest"] == "digest-0"


def test_no_second_record_when_the_writer_lives_or_already_wrote_it(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    writer, other = member(store, 1, log), member(store, 0, log)
    applied(writer, 5, 1)
    writer.wait_records()
    assert int(store.get("last_commit")) == 5
    applied(other, 5, 1)
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
    applied(survivor, 5, 1)
    survivor.finish(5, timeout_s=0.3)  # the writer is not (yet) declared dead: wait, give up
    assert records(log) == [] and not store.check(["last_commit"])
    store.set("dead/1", json.dumps({"epoch": 1, "reason": "process exited with code -9"}))
    survivor.finish(5, timeout_s=5.0)
    assert [r["param_digest"] for r in records(log)] == ["digest-0"]


def test_publish_counts_and_the_last_member_commits_with_the_next_plan(store, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    plan = Plan(0, MEMBERS, {})
    watched = []
    counts = []
    for m in MEMBERS:  # done records are staged (test fixture): publish only counts
        s = member(store, m, log)
        counts.append(s.publish(6, 0, (m,), [], True, len(MEMBERS), plan, lambda *k: watched.append(k)).result())
    assert [c for c, _ in counts] == [1, 2, 3]
    assert [d for _, d in counts[:2]] == [None, None] and watched == [(6, 0), (6, 0)]  # they wait on the watch
    assert counts[2][1] == Decision("commit", 2, plan)  # the last proposes, carrying step 7's plan
    assert Decision.loads(store.get("decision/6/0")) == counts[2][1]


def test_a_group_s_record_digest_is_the_sha256_of_its_ranks_shard_digests_and_its_loss_their_sum(store, tmp_path):
    """Member 1 is a group of 2 ranks: rank 1 posts its shard's digest and loss share, rank 0 (the
    writer) hashes both in rank order; no rank reads the parameters (the digests are `apply`'s)."""
    log = EventLog(tmp_path / "events.jsonl")
    ranks = [Sidecar(Coordination(TCPStore("127.0.0.1", store.port, 1, False), 1, rank=j), log, 2, 5.0, (j,))
             for j in (0, 1)]
    for j, s in enumerate(ranks):
        s.record(5, 0, MEMBERS, 1, {"step": 5, "loss": 0.25 * (j + 1)}, {j: f"shard-{j}"})
    for s in ranks:
        s.wait_records()
    (rec,) = records(log)
    assert rec["param_digest"] == hashlib.sha256(b"shard-0shard-1").hexdigest() and rec["loss"] == 0.75
    for m in MEMBERS:
        store.set(f"done/6/0/{m}", store.get(f"done/5/0/{m}"))
    stand_in = Sidecar(Coordination(TCPStore("127.0.0.1", store.port, 1, False), 2), log, 2, 5.0, (0, 1))
    stand_in.record(6, 0, MEMBERS, 2, {"step": 6, "loss": 0.5}, {0: "shard-0", 1: "shard-1"})
    stand_in.wait_records()  # a re-formed group's one rank holding both shard indices: no post to wait for
    assert records(log)[-1]["param_digest"] == rec["param_digest"] and records(log)[-1]["loss"] == 0.5
    with pytest.raises(KeyError):  # a shard index it holds without its digest
        stand_in.record(7, 0, MEMBERS, 2, {"step": 7, "loss": 0.5}, {0: "shard-0"})


def test_the_commit_carries_weights_the_coordinator_published_after_the_last_record(store, tmp_path):
    """A verdict reached just after step 5's commit (weights published once its record was out) plans
    step 7 through step 6's commit: read at the proposal, not step 7 with step 8's (the plan of step 6
    came with step 5's commit). Without the re-read the proposal carries the weights read at the record."""
    from unbroken.runtime.store.watch import WeightsWatch, publish_weights, stop

    log = EventLog(tmp_path / "events.jsonl")

    def client():
        return TCPStore("127.0.0.1", store.port, 1, False)
    members = [Sidecar(Coordination(client(), m, weights=WeightsWatch(client())), log) for m in MEMBERS]
    for s in members:
        applied(s, 5, 1)
        s.wait_records()
    assert members[0].weights == {}
    publish_weights(store, json.dumps({"0": 1.0, "1": 1.0, "2": 0.5}))
    for s in members:  # each member's own watch: the last one proposes (seen in CI: only member 0's was awaited)
        watch = s.coord._weights_watch
        assert watch.wait_until(lambda w=watch: w.current == 1, 5.0)
    stale = Plan(0, MEMBERS, members[0].weights)  # the trainer's proposal, from the weights read at the record
    for m, s in enumerate(members):
        count, won = s.publish(6, 0, (m,), [], True, len(MEMBERS), stale, lambda *k: None).result()
    assert won == Decision("commit", 2, Plan(0, MEMBERS, {0: 1.0, 1: 1.0, 2: 0.5}))
    assert members[0].fresh(stale) == Plan(0, MEMBERS, {0: 1.0, 1: 1.0, 2: 0.5})  # the path without step-ahead
    assert members[2].fresh(won.plan) is won.plan  # the proposer read them: no store read, the same plan
    watches = [s.coord._weights_watch for s in members]
    stop(watches, store)  # before the fixture's server goes: else each prints a C++ warning (seen in CI)
    assert not any(w._thread.is_alive() for w in watches)


def test_close_waits_for_the_running_job_and_cancels_the_queued_ones(store, tmp_path):
    """A group's survivor lets its trainer go before building the whole model: `close` waits for the
    sidecar's running job (here a plan's compare-and-set held up 0.5 s), up to its timeout, and drops what
    was queued behind it; after it, nothing on the sidecar's thread holds a job's arguments."""
    log = EventLog(tmp_path / "events.jsonl")
    release = threading.Event()
    sidecar = member(store, 0, log)
    agree = sidecar.coord.agree_plan
    sidecar.coord.agree_plan = lambda step, mine: (release.wait(5), agree(step, mine))[1]
    plan = Plan(0, MEMBERS, {})
    alive = weakref.ref(plan)
    running = sidecar.plan(5, plan)  # blocks until `release`
    del plan
    applied(sidecar, 5, 0)  # queued behind it: its record is never written
    queued = sidecar._records
    t0 = time.monotonic()
    assert sidecar.close(0.2) is False  # still running after 0.2 s: said, not waited out
    assert 0.2 <= time.monotonic() - t0 < 2 and queued.cancelled()
    threading.Timer(0.3, release.set).start()
    assert sidecar.close(5) is True  # the running job ended within the timeout
    assert running.result() == Plan(0, MEMBERS, {})  # the job it waited for did its work
    del sidecar, running
    gc.collect()
    assert alive() is None
    assert records(log) == []
