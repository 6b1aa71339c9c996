"""The fold behind /metrics, status and report, on hand-written logs whose answers are known: an in-step
recovery timed from the fault that caused it, a re-formed epoch, a whole-job restart whose redone steps
count once, snapshots, verdicts, and a log fed in pieces giving what one feed gives."""
from __future__ import annotations

from unbroken.observe.view import RunView, cause_of


def _log() -> list[dict]:
    step = lambda s, t, members, epoch=0: {"event": "step", "t": t, "step": s, "loss": 5.0 - s, "tokens": 100,
                                           "microbatches": 4, "replicas": len(members), "epoch": epoch,
                                           "owners": {str(m): [] for m in members}}
    return [
        {"event": "run_start", "t": 100.0, "replicas": 3, "steps": 6, "microbatches": 4, "run_id": "r", "schema": 1},
        {"event": "epoch", "t": 101.0, "epoch": 0, "members": [0, 1, 2]},
        step(0, 110.0, [0, 1, 2]),
        {"event": "fault", "t": 110.5, "kind": "kill", "replica": 2, "step": 1, "phase": "allreduce"},
        {"event": "member_dead", "t": 111.0, "replica": 2, "epoch": 1, "reason": "process exited with code -9"},
        {"event": "epoch", "t": 111.0, "epoch": 1, "members": [0, 1]},
        {"event": "decision", "t": 111.1, "step": 1, "epoch": 0, "outcome": "retry", "replica": 0},
        {"event": "recovery", "t": 111.2, "step": 1, "replica": 0, "from_epoch": 0, "to_epoch": 1, "redo": [3]},
        {"event": "recovery", "t": 111.3, "step": 1, "replica": 1, "from_epoch": 0, "to_epoch": 1, "redo": [2]},
        step(1, 112.5, [0, 1], 1),
        {"event": "epoch", "t": 113.0, "epoch": 2, "members": [0, 1], "reform": "gloo broke"},
        {"event": "recovery", "t": 113.1, "step": 2, "replica": 0, "from_epoch": 1, "to_epoch": 2, "redo": []},
        step(2, 113.4, [0, 1], 2),
        {"event": "verdict", "t": 113.5, "step": 2, "replica": 1, "old": "healthy", "new": "slow", "speed": 0.4,
         "score": 0.3},
        {"event": "verdict", "t": 113.5, "step": 0, "replica": 2, "old": "healthy", "new": "suspect", "speed": 0.9,
         "score": 0.7},  # judged after its death (the detector trails the run): it stays dead
        {"event": "snapshot", "t": 113.6, "replica": 0, "share": 0, "step": 2},
        {"event": "snapshot_skipped", "t": 113.6, "replica": 1, "share": 1, "step": 2},
        {"event": "fault", "t": 114.0, "kind": "crash-all", "step": 3},
        {"event": "restart", "t": 115.0, "generation": 1, "reason": "all lost", "source": "memory"},
        {"event": "epoch", "t": 118.0, "epoch": 0, "members": [0, 1, 2]},
        step(2, 119.0, [0, 1, 2]),  # redone after the restart: counts once
        step(3, 120.0, [0, 1, 2]),
        {"event": "run_end", "t": 121.0, "ok": True},
    ]


def test_the_fold_gives_the_known_answers():
    v = RunView()
    v.feed(_log())
    assert v.frontier == 3 and v.tokens == 400 and v.steps_redone == 1 and v.step_records == 5
    kill, reform, restart = v.incidents
    assert (kill.step, kill.cause, kill.redo, kill.start, kill.end) == (1, "exit", {2, 3}, 110.5, 112.5)
    assert abs(kill.seconds - 2.0) < 1e-9  # from the fault, not from the verdict
    assert (reform.cause, reform.start, reform.end) == ("reform", 113.0, 113.4)
    assert (restart.step, restart.cause, restart.start, restart.end) == (3, "restart-memory", 114.0, 120.0)
    assert v.retries == {"exit": 1} and v.restarts == {"memory": 1} and v.generation == 1
    assert v.live == [(101.0, 3), (111.0, 2), (113.0, 2), (118.0, 3)]
    assert v.verdicts == {"slow": 1, "suspect": 1}
    assert v.health == {1: "slow"} and v.speed == {1: 0.4} and v.dead == {}  # the new generation has all 3
    s = v.status(125.0)
    assert s["snapshot"] == {"step": 2, "age_s": 125.0 - 113.6, "steps_behind": 1} and s["snapshots_skipped"] == 1
    assert s["finished"] and s["ok"] and s["step"] == 3 and [i["cause"] for i in s["incidents"]] == [
        "exit", "reform", "restart-memory"]
    assert v.tokens_per_second() == (400 - 100) / (120.0 - 110.0)  # tokens gained after the first commit


def test_feeding_in_pieces_equals_one_feed():
    whole, pieces = RunView(), RunView()
    whole.feed(_log())
    log = _log()
    shown = []
    for i in range(0, len(log), 3):
        shown += pieces.feed(log[i:i + 3])
    assert pieces.status(130.0) == whole.status(130.0)
    kinds = [k for k, _ in shown]
    assert kinds.count("step") == 4 and kinds.count("incident") == 3 and kinds.count("fault") == 2


def test_a_restart_cuts_an_in_step_recovery_short_without_counting_a_second_twice():
    log = _log()[:9]  # up to the two survivors' recovery records of step 1
    log += [{"event": "restart", "t": 112.0, "generation": 1, "reason": "restart mode", "source": "memory"},
            {"event": "epoch", "t": 116.0, "epoch": 0, "members": [0, 1, 2]},
            {"event": "step", "t": 117.0, "step": 1, "loss": 4.0, "tokens": 100, "microbatches": 4, "replicas": 3,
             "epoch": 0, "owners": {"0": [0], "1": [1], "2": [2, 3]}}]
    v = RunView()
    v.feed(log)
    cut, restart = v.incidents
    assert (cut.start, cut.end, cut.superseded) == (110.5, 112.0, True)
    assert (restart.start, restart.end, restart.superseded) == (112.0, 117.0, False)


def test_without_history_memory_stays_small_and_the_figures_stay_the_same():
    full, lean = RunView(), RunView(history=False)
    full.feed(_log())
    lean.feed(_log())
    assert lean.status(130.0) == full.status(130.0)
    assert list(lean.committed) == [3] and len(full.committed) == 4


def test_causes():
    assert cause_of("process exited with code -9") == "exit"
    assert cause_of("no heartbeat for 3.1 s") == "heartbeat"
    assert cause_of("stuck in step 3 microbatch 1 for 20.5 s") == "stuck"
    assert cause_of("lost with node 1") == "other"
    assert cause_of("evicted: state corrupted 2 times") == cause_of("non-finite gradient or loss: x") == "corruption"
