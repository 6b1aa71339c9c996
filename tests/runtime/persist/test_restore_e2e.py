"""Restore paths of issue 3 through `unbroken train`, real processes, --exact, against the failure-free run.

Every restore path must end on the failure-free trajectory: every committed step's param_digest equals
the reference's (a redone step after a restart must reproduce it too), and the exactly-once audit holds.
Runs here use 4 replicas and 12 steps, as the reference in conftest does.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import BASE, unbroken
from unbroken.events import read_events
from unbroken.observe.runs import audit, compare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

XOR2 = ["--snapshot.enabled=true", "--snapshot.nodes=2", "--snapshot.parity=xor", "--snapshot.k=1", "--snapshot.m=1"]


def run(tmp_path, faults: str, *extra: str):
    out = tmp_path / "run"
    # agents encoding parity load the 2 cores; no hang is timed here, so a roomier heartbeat timeout
    # keeps a starved heartbeat thread from adding a restart (the trajectory would still be exact)
    r = unbroken("train", *BASE, "--coord.heartbeat_timeout=5", "--faults", faults, "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, read_events(out)


def on_trajectory(reference, out):
    cmp = compare(reference, out)
    assert cmp.identical == cmp.total == 12, [row for row in cmp.rows if not row[3]]
    assert audit(out, 8) == []


def restored(events, source, reference=None, out=None):
    """The `restored` records of `source`; with `reference`, each must have loaded exactly the
    failure-free run's parameters of the step it restored."""
    got = [e for e in events if e["event"] == "restored" and e["source"] == source]
    if reference is not None:
        ref = {e["step"]: e["param_digest"] for e in read_events(reference) if e["event"] == "step"}
        assert got, why_not_restored(events, out)
        assert all(e["param_digest"] == ref[e["step"]] for e in got)
    return got


def why_not_restored(events, out) -> str:
    """What a failed restore expectation needs to be diagnosed: where each restore came from, which
    snapshots were skipped (their agents behind), and what the agents reported."""
    logs = sorted(Path(out, "logs").glob("agent*.log")) if out else []
    lines = [line for f in logs for line in f.read_text().splitlines() if line.startswith("[agent")]
    return (f"restored: {[(e['replica'], e['source'], e['step']) for e in events if e['event'] == 'restored']}; "
            f"skipped: {[(e['share'], e['step']) for e in events if e['event'] == 'snapshot_skipped']}; "
            f"agents: {lines}")


def redone_after_restart(events, restart, step, steps: int = 12) -> None:
    """The whole-job `restart` record took the run back to `step`: the generation it began recorded
    every step after `step`, from step + 1 to the run's last (of `steps`), and each step the generation
    before it had committed past `step` was lost with the crash and recorded again (a copy on each side
    of the restart)."""
    at = events.index(restart)
    before = [e["step"] for e in events[:at] if e["event"] == "step"]
    after = [e["step"] for e in events[at:] if e["event"] == "step"]
    assert after == list(range(step + 1, steps)), (step, after)
    assert all(s in after for s in before if s > step), (step, before, after)


def test_crash_all_resumes_from_memory_at_the_last_snapshot(reference, tmp_path):
    # The launcher fires crash-all once it sees step 5's record. Replica 0 sleeps through 20x its step-6
    # compute (wall time only), so the kill lands inside step 6 rather than after step 6 committed and
    # was snapshotted, which a launcher slower to see step 5's record would otherwise allow
    out, events = run(tmp_path, "crash-all:step=6; slow:replica=0,from=6,to=7,factor=20,how=sleep", *XOR2)
    on_trajectory(reference, out)
    # the crash fired on every trainer as step 6 began, and the job restarted from memory after it
    (crash,) = [e for e in events if e["event"] == "fault"]
    assert (crash["kind"], crash["step"], crash["replicas"]) == ("crash-all", 6, [0, 1, 2, 3]), crash
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert restart["source"] == "memory" and events.index(crash) < events.index(restart), restart
    got = restored(events, "memory", reference, out)
    # a snapshot from before the crash (the newest whose parity was complete: saves are skipped, never
    # waited on, while parity lags), loaded bit-exactly: restored() checked its digest
    assert len(got) >= 4 and len({e["step"] for e in got}) == 1 and 0 <= got[0]["step"] <= 5
    # the work after that snapshot was lost: every later step was run again after the restart
    redone_after_restart(events, restart, got[0]["step"])


def test_node_loss_rebuilt_from_xor_parity(reference, tmp_path):
    # step 8, not 5: the agents' first encodes are slow, so a loss at 5 may find no snapshot sealed yet
    # (then the run restarts from scratch, still on the trajectory, and nothing is rebuilt: once in CI)
    out, events = run(tmp_path, "node:node=1,step=8", "--run.recovery=restart-memory", *XOR2)
    on_trajectory(reference, out)
    rebuilt = [e for e in events if e["event"] == "rebuilt"]
    assert rebuilt and rebuilt[0]["nodes"] == [1] and rebuilt[0]["parity"] == "xor"
    got = restored(events, "memory", reference, out)
    assert len(got) >= 4 and got[0]["step"] <= rebuilt[0]["step"]


def test_two_nodes_lost_rebuilt_from_reed_solomon(reference, tmp_path):
    # Step 8, not 5: the agents' first RS encodes are slow (a run here skipped the snapshots of steps 1-3
    # and restored step 0), so a loss at step 5 found at most step 0 sealed, and under CI's load once
    # none (no `rebuilt` event: the run restarted from scratch, on the trajectory all the same)
    out, events = run(tmp_path, "node:node=1,step=8; node:node=2,step=8", "--run.recovery=restart-memory",
                      "--snapshot.enabled=true", "--snapshot.nodes=4", "--snapshot.parity=rs",
                      "--snapshot.k=2", "--snapshot.m=2")
    on_trajectory(reference, out)
    rebuilt = [e for e in events if e["event"] == "rebuilt"]
    assert rebuilt and rebuilt[0]["nodes"] == [1, 2] and rebuilt[0]["parity"] == "rs", (
        f"{[e for e in events if e['event'] in ('rebuild_failed', 'restart')]}; {why_not_restored(events, out)}")
    assert len(restored(events, "memory", reference, out)) >= 4


def test_corrupted_shard_is_caught_and_never_loaded(reference, tmp_path):
    out, events = run(tmp_path, "corrupt:replica=1,step=4; crash-all:step=6", *XOR2)
    on_trajectory(reference, out)
    corrupt = next(e for e in events if e["event"] == "fault" and e["kind"] == "corrupt")
    hit = corrupt["corrupted_step"]
    assert hit is not None  # the flipped slot is of the step the restore reads (chaos.py)
    # the restore read that shard, its checksum refused it, the agents rebuilt it from parity...
    rejected = [e for e in events if e["event"] == "shard_rejected"]
    assert [(e["replica"], e["step"], e["rebuilt"]) for e in rejected] == [(1, hit, True)], rejected
    # ...and every replica loaded step `hit`, the failure-free run's parameters of it (restored checks)
    got = restored(events, "memory", reference, out)
    assert len(got) >= 4 and {e["step"] for e in got} == {hit}, got


def test_trainer_killed_during_its_snapshot_copy(reference, tmp_path):
    out, events = run(tmp_path, "tear:replica=0,step=5", "--run.recovery=restart-memory",
                      "--snapshot.enabled=true")
    on_trajectory(reference, out)
    fault = [e for e in events if e["event"] == "fault" and e["kind"] == "tear"]
    assert [(e["replica"], e["step"], e["phase"]) for e in fault] == [(0, 5, "snapshot")]
    # the copy of step 5 was cut off: its slot still WRITING at the restart...
    assert {(e["replica"], e["step"]) for e in events if e["event"] == "torn"} == {(0, 5)}
    # ...and never restored: every replica loaded an older whole snapshot, the failure-free one
    got = restored(events, "memory", reference, out)
    assert len(got) >= 4 and max(e["step"] for e in got) < 5


def test_restart_disk_baseline_loses_the_work_since_the_checkpoint(reference, tmp_path):
    out, events = run(tmp_path, "kill:replica=2,step=7,phase=compute", "--run.recovery=restart-disk",
                      "--checkpoint.every=3")
    on_trajectory(reference, out)
    # the kill fired in replica 2's step-7 compute, the replica was lost, and the whole job restarted
    # from disk for it
    (kill,) = [e for e in events if e["event"] == "fault"]
    assert (kill["kind"], kill["replica"], kill["step"], kill["phase"]) == ("kill", 2, 7, "compute"), kill
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert restart["source"] == "disk" and restart["reason"].startswith("1 of 4 replicas lost"), restart
    assert 2 in {e["replica"] for e in events if e["event"] == "member_dead"}
    # checkpoints at 0, 3, 6: the newest *complete* one (an async save of 6 may still be on its way)
    got = restored(events, "disk", reference, out)
    assert len(got) >= 4 and len({e["step"] for e in got}) == 1 and got[0]["step"] in (3, 6)
    # the work since that checkpoint was lost: steps 4-6 (or none past 6) were recorded again
    redone_after_restart(events, restart, got[0]["step"])


def test_live_node_loss_then_crash_all_restores_adopted_shares(reference, tmp_path):
    # Until node 1's replacement agent is up (a fresh process importing torch: seconds under load)
    # and node 0's agent has given up the encode it had begun with the dead one (agents' collective
    # timeout: 15 s), parity cannot complete and survivors skip snapshots; steps of ~0.1 s would reach
    # the crash first. Slowing the survivors' steps 4-7 to ~5 s each (time only: the trajectory is
    # the same) leaves room for both.
    slow = "; ".join(f"slow:replica={r},from=4,to=8,factor=100" for r in (0, 1))
    # (progress_timeout raised: on a loaded host one 100x microbatch could pass the default 20 s)
    out, events = run(tmp_path, f"node:node=1,step=3; crash-all:step=8; {slow}", *XOR2,
                      "--coord.progress_timeout=120")
    on_trajectory(reference, out)
    # node 1 (replicas 2 and 3) was lost as step 3 began, and the run went on live: both were declared
    # dead, with no restart, before the crash of every trainer as step 8 began
    node, crash = (next(e for e in events if e["event"] == "fault" and e["kind"] == kind)
                   for kind in ("node", "crash-all"))
    assert (node["node"], node["step"], node["replicas"]) == (1, 3, [2, 3]), node
    assert crash["step"] == 8, crash
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert events.index(node) < events.index(crash) < events.index(restart) and restart["source"] == "memory"
    dead = [e for e in events[events.index(node):events.index(crash)] if e["event"] == "member_dead"]
    assert sorted(e["replica"] for e in dead) == [2, 3], dead
    got = restored(events, "memory", reference, out)
    assert len(got) >= 4 and len({e["step"] for e in got}) == 1 and 3 <= got[0]["step"] <= 7
    # adopted shares kept snapshots after the loss: the step restored was snapshotted before the crash,
    # dead replica 2's share by survivor 0 and 3's by 1 (policy.snapshotting.share_owner); no log record
    # names an adoption, the `snapshot` records' replica/share pairs are what says so
    s = got[0]["step"]
    wrote = {(e["replica"], e["share"]) for e in events[:events.index(restart)]
             if e["event"] == "snapshot" and e["step"] == s}
    assert wrote == {(0, 0), (1, 1), (0, 2), (1, 3)}, (s, wrote)


def test_bad_snapshot_config_is_one_line(tmp_path):
    r = unbroken("train", "--replicas", "4", "--snapshot.enabled=true", "--snapshot.nodes=3",
                 "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "snapshot.nodes=3" in r.stderr
    r = unbroken("train", "--replicas", "4", "--faults", "corrupt:replica=1,step=2", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "needs in-memory snapshots" in r.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_failure_before_any_snapshot_starts_over_exactly(reference, tmp_path):
    """Nothing to restore yet: the restarted job starts from step 0 exactly as a fresh run would
    (no optimizer state left over from preparing a restore)."""
    out, events = run(tmp_path, "kill:replica=1,step=0,phase=compute", "--run.recovery=restart-memory",
                      "--snapshot.enabled=true")
    on_trajectory(reference, out)
    # the kill fired in replica 1's step-0 compute, and the job restarted with no step committed and no
    # snapshot taken before it
    (kill,) = [e for e in events if e["event"] == "fault"]
    assert (kill["kind"], kill["replica"], kill["step"], kill["phase"]) == ("kill", 1, 0, "compute"), kill
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert events.index(kill) < events.index(restart), restart
    assert not [e for e in events[:events.index(restart)] if e["event"] in ("step", "snapshot")]
    assert len(restored(events, "scratch")) >= 4
