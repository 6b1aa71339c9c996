"""The coordinator's slowness loop reads a step's timings from its commit, not from its record.

A member stepping ahead writes step s's record (and moves `last_commit`) only after step s+1's compute,
but the plan of step s+2 is proposed at step s+1's commit: weights published after the record came one
step late in 2 of 5 real runs (2 replicas, one 2x slow). A real store protocol is not needed to show
the order: the keys are the ones members write (decision at the commit, last_commit with the record).
"""
from __future__ import annotations

import json

from torch.distributed import HashStore

from unbroken.events import EventLog, read_events
from unbroken.runtime.store import keys
from unbroken.runtime.coordinator.coordinator import Coordinator
from unbroken.runtime.coordinator.slowness import SlownessMonitor


def commit_only(store, step: int, slow: float) -> None:
    """Step `step` decided commit in epoch 0 (replicas 0 and 1 done, 4 microbatches each), no record yet."""
    store.set(keys.decision(step, 0), "commit@0")
    for m, factor in ((0, 1.0), (1, slow)):
        store.set(keys.done(step, 0, m), json.dumps({"timings": [[256, 256 * 64, 0.05 * factor]] * 4}))


def test_weights_go_out_at_the_commit_of_the_step_that_shows_the_slowdown(tmp_path):
    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.weights(), "{}")
    log = EventLog(tmp_path / "events.jsonl", who="coordinator")
    monitor = SlownessMonitor(store, log, quotas="speed")
    published_at = None
    for s in range(8):
        commit_only(store, s, slow=2.0 if s >= 3 else 1.0)
        if s > 0:
            store.set(keys.last_commit(), str(s - 1))  # the record of the step before, written meanwhile
        monitor.poll(0)
        assert monitor.next_step == s + 1  # every committed step read, its record or not
        if published_at is None and json.loads(store.get(keys.weights())):
            published_at = s
    events = read_events(tmp_path)
    (slow,) = [e for e in events if e["event"] == "verdict" and e["new"] == "slow"]
    (quotas,) = [e for e in events if e["event"] == "quotas"]
    assert slow["replica"] == 1 and slow["step"] == published_at == quotas["step"], events
    assert quotas["weights"]["1"] < 0.75, quotas  # about 0.5: the 2x replica's speed
    monitor.poll(0)  # nothing new: step 8 is not committed
    assert monitor.next_step == 8


def test_the_coordinator_reads_the_last_steps_once_every_member_finished(tmp_path):
    """Beat rounds read committed steps: the round that finds every member finished reads the steps
    committed since the last one (the run's last steps, where a late re-plan is measured: a grow back's
    `group_plan_measured` went missing in CI when the run ended 3 steps after it)."""
    store = HashStore()
    log = EventLog(tmp_path / "events.jsonl", who="coordinator")
    coord = Coordinator(store, 2, log, heartbeat_timeout=60, progress_timeout=60, startup_timeout=60, beat_every=1.0)
    commit_only(store, 0, slow=1.0)
    assert coord.poll(0.0) and coord.slowness.next_step == 1  # a beat round: step 0 read
    for s in (1, 2):  # the last steps commit between beat rounds, and both members finish
        commit_only(store, s, slow=1.0)
    store.set(keys.last_commit(), "2")
    for m in (0, 1):
        store.set(keys.finished(m), "1")
        store.add(keys.finished_count(), 1)
    assert coord.poll(0.5) and coord.slowness.next_step == 1  # not a beat round: nothing read
    assert coord.poll(1.0) and coord.all_finished()
    assert coord.slowness.next_step == 3  # steps 1 and 2 read before the coordinator stops


def test_a_group_s_ranks_time_themselves_and_the_monitor_takes_the_slowest(tmp_path):
    """In a group of several ranks each rank writes its own device seconds with the done record
    (`Coordination.stage`: rank 0 the record, saying how many ranks, rank j > 0 its own); the monitor
    times each microbatch at its slowest rank's seconds, with every rank's by rank, as the locator
    needs them. A member whose rank record is missing is timed by rank 0 alone, not mislabelled."""
    from unbroken.policy.predictor import MicrobatchTiming
    from unbroken.runtime.trainer.membership import Coordination

    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.decision(5, 0), "commit@0")
    held = (2, 3)
    own = {(0, 0): (0.12, 0.13), (0, 1): (0.12, 0.13), (1, 0): (0.12, 0.13), (1, 1): (0.32, 0.33)}
    for (m, rank), seconds in own.items():  # member 1's rank 1 is slow; member 0's ranks are even
        Coordination(store, m, rank=rank).stage(5, 0, held, [(64, 4096, s) for s in seconds], ranks=2)
    assert json.loads(store.get(keys.done(5, 0, 1)))["ranks"] == 2
    assert not store.check([keys.rank_done(5, 0, 1, 0)])  # rank 0's own seconds are in the record
    monitor = SlownessMonitor(store, EventLog(tmp_path / "events.jsonl", who="coordinator"), quotas="speed")
    timings = monitor._timings(5, 0)
    assert timings[1] == [MicrobatchTiming(64, 4096, 0.32, (0.12, 0.32)), MicrobatchTiming(64, 4096, 0.33, (0.13, 0.33))]
    assert [t.seconds for t in timings[0]] == [0.12, 0.13]
    store.delete_key(keys.rank_done(5, 0, 1, 1))
    assert monitor._timings(5, 0)[1] == [MicrobatchTiming(64, 4096, 0.12, ()), MicrobatchTiming(64, 4096, 0.13, ())]
    # a one-rank member (or a stand-in) writes the record alone, without `ranks`
    Coordination(store, 0).stage(6, 0, held, [(64, 4096, 0.1)] * 2)
    assert "ranks" not in json.loads(store.get(keys.done(6, 0, 0)))
