"""A coordinator that takes over (etcd standby) rebuilds its fail-slow detector from the store's recent steps.

Replaying every committed step from 0 would cost a month-long job millions of store reads at the moment
it has no leader; catch_up() replays the last detector.replay_steps, logs none of their events again, and then the
detector judges new steps as before: a replica 2x slow in the replayed window is still found slow.
"""
from __future__ import annotations

import json

from torch.distributed import HashStore

from unbroken.events import EventLog, read_events
from unbroken.runtime.store import keys
from unbroken.config import DetectorSection
from unbroken.runtime.coordinator.slowness import SlownessMonitor


def committed(store, step: int, slow: float = 1.0) -> None:
    """Step `step` committed in epoch 0 by replicas 0 and 1, 4 microbatches each; replica 1 `slow` x."""
    store.set(keys.decision(step, 0), "commit@0")
    for m, factor in ((0, 1.0), (1, slow)):
        timings = [[256, 256 * 64, 0.05 * factor] for _ in range(4)]
        store.set(keys.done(step, 0, m), json.dumps({"timings": timings}))
    store.set(keys.last_commit(), str(step))


class Counting(SlownessMonitor):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.read_steps: list[int] = []

    def _timings(self, step, epoch):
        self.read_steps.append(step)
        return super()._timings(step, epoch)


def test_a_takeover_replays_only_the_recent_steps_and_still_sees_a_slow_replica(tmp_path):
    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.weights(), "{}")
    for s in range(300):
        committed(store, s, slow=2.0 if s >= 280 else 1.0)  # replica 1 slow over the last 20 steps
    log = EventLog(tmp_path / "events.jsonl", who="coordinator")
    monitor = Counting(store, log, quotas="speed")
    monitor.catch_up()
    monitor.poll(0)
    assert monitor.read_steps == list(range(300 - DetectorSection().replay_steps, 300))  # not from step 0
    assert not (tmp_path / "events.jsonl").exists() or read_events(tmp_path) == []  # replayed: not logged again
    for s in range(300, 304):  # new steps: judged and logged as before
        committed(store, s, slow=2.0)
    monitor.poll(0)
    assert monitor.read_steps[-4:] == [300, 301, 302, 303]
    speeds = monitor.detector.speeds()
    assert speeds[1] < 0.75 * speeds[0], speeds  # the slow replica is known from the replayed window


def test_a_takeover_prices_a_rank_lost_before_its_first_new_step(tmp_path):
    """Groups of 2 pipeline stages under replan: the new leader's first act may be a rank loss. The
    replayed steps' timings calibrate the cost model, so the scheduler decides (`group_plan`) instead of
    dropping the group for want of timings (`group_plan_skipped`: what a takeover did before)."""
    from unbroken.runtime.coordinator.replan import GroupShape, planner_for

    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.weights(), "{}")
    for s in range(20):
        committed(store, s)
    log = EventLog(tmp_path / "events.jsonl", who="coordinator")
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=1000,
                       reform_seconds=0.1)
    monitor = SlownessMonitor(store, log, quotas="speed", planner=planner_for(shape, 2, log, "speed"))
    monitor.catch_up()
    monitor.poll(0)  # replays steps 0..19; no new step committed yet
    monitor.forget(1)  # group 1's rank 1 died: its group was declared dead
    assert monitor.rank_lost(1, [0], [0]) in ("shrink", "drop")
    events = read_events(tmp_path)
    assert not [e for e in events if e["event"] == "group_plan_skipped"], events
    (plan,) = [e for e in events if e["event"] == "group_plan"]
    assert plan["why"] == "rank lost" and plan["replica"] == 1 and plan["per_microbatch_seconds"] > 0
    assert {o["kind"] for o in plan["options"]} == {"drop", "shrink"}


def test_a_takeover_knows_which_groups_run_shrunk_and_sees_them_grow_back(tmp_path):
    """The leader shrank group 1 onto its surviving stage, then died. Its successor must price group 1
    as the one-rank plan it runs (not as a reweighted full group: that is all the weights say), and
    when group 1's lost rank is back, log the grow (`ranks back`) and give it equal quotas again."""
    from unbroken.runtime.coordinator.replan import GroupShape, planner_for

    store = HashStore()
    store.set(keys.members(0), json.dumps([0, 1]))
    store.set(keys.weights(), "{}")
    for s in range(20):
        committed(store, s)
    shape = GroupShape(group_size=2, tp=1, pp=2, layers=2, width=64, microbatches=8, steps=1000,
                       reform_seconds=0.1)

    def monitor(name: str) -> SlownessMonitor:
        (tmp_path / name).mkdir()
        log = EventLog(tmp_path / name / "events.jsonl", who="coordinator")
        return SlownessMonitor(store, log, quotas="speed", planner=planner_for(shape, 2, log, "speed"))
    leader = monitor("leader")
    leader.poll(0)
    leader.forget(1)
    assert leader.rank_lost(1, [0], [0]) == "shrink"
    (plan,) = [e for e in read_events(tmp_path / "leader") if e["event"] == "group_plan"]
    shrunk = leader.planner.shrunk[1]
    assert plan["applied"] == "shrink" and shrunk.weight < 1.0

    successor = monitor("successor")  # the leader is gone; the standby takes over
    successor.catch_up()
    successor.poll(0)
    assert successor.planner.shrunk == {1: shrunk} and successor.planner.reweighted == {}
    assert successor.planner.weight_of(1, 0.9) == shrunk.weight  # its plan's weight, not a measured speed
    successor.forget(1)  # the shrunk group is declared dead: its replaced rank's agent re-formed it
    successor.ranks_back(1, [0])
    (grow,) = [e for e in read_events(tmp_path / "successor") if e["event"] == "group_plan"]
    assert grow["why"] == "ranks back" and grow["replica"] == 1 and grow["applied"] == "grow", grow
    assert json.loads(store.get(keys.weights()))["1"] == 1.0
    assert json.loads(store.get(keys.shrunk())) == {}
    assert successor.planner.weight_of(1, 1.0) == 1.0
