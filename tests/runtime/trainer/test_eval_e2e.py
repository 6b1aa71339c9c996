"""Validation loss through a fault: a replica killed in the middle of an evaluation (after its first
evaluation microbatch) leaves its unfinished share to the survivors, and every `eval` record is the
failure-free run's bit for bit under --exact; the report draws it beside the training loss. Bad [eval]
settings are refused before start in one line. The same in groups of 2 FSDP2 ranks and of 2 pipeline
stages, a rank of one killed."""
from __future__ import annotations

import pytest

from tests.conftest import side_by_side, unbroken
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = ["--replicas", "3", "--steps", "6", "--microbatches", "4", "--exact", "--launch.progress=false",
       "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200",
       "--data.max_files=40", "--eval.every=2", "--eval.split=0.1", "--eval.microbatches=7"]


def evals(run) -> dict[int, dict]:
    return {e["step"]: e for e in read_events(run) if e["event"] == "eval"}


def test_a_rank_killed_during_an_evaluation_leaves_the_value_bitwise_the_failure_free_one(tmp_path):
    ref, faulty = side_by_side(
        lambda: unbroken("train", *RUN, "--out", str(tmp_path / "ref")),
        lambda: unbroken("train", *RUN, "--faults", "kill:replica=1,step=3,phase=eval", "--out", str(tmp_path / "kill")))
    assert ref.returncode == 0 and faulty.returncode == 0, (ref.stderr[-1500:], faulty.stderr[-1500:])
    fired = [e for e in read_events(tmp_path / "kill") if e["event"] == "fault"]
    assert [(e["replica"], e["step"], e["phase"]) for e in fired] == [(1, 3, "eval")]
    a, b = evals(tmp_path / "ref"), evals(tmp_path / "kill")
    assert sorted(a) == sorted(b) == [1, 3, 5]  # after 2, 4 and 6 committed steps
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]  # JSON floats: equal means bitwise
    # the failure-free split: i to the (i mod 3)-th member; replica 1 computed microbatch 1, then died: its
    # other one (4) was computed by a survivor
    assert a[3]["owners"] == {"0": [0, 3, 6], "1": [1, 4], "2": [2, 5]}
    assert b[3]["owners"]["1"] == [1] and 4 in b[3]["owners"]["0"] + b[3]["owners"]["2"]
    assert sorted(b[5]["owners"]) == ["0", "2"]  # the next evaluation: the two survivors share it out
    ra, rb = steps(read_events(tmp_path / "ref")), steps(read_events(tmp_path / "kill"))
    assert [ra[s]["param_digest"] for s in range(6)] == [rb[s]["param_digest"] for s in range(6)]
    r = unbroken("report", str(tmp_path / "kill"))
    assert r.returncode == 0, r.stderr[-1000:]
    assert "loss (9)" in r.stdout  # 6 training steps and 3 evaluations on the loss panel


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_in_groups_of_two_ranks_a_rank_killed_mid_evaluation_leaves_the_value_bitwise_the_failure_free_one(
        tmp_path, layout):
    """2 groups of 2 ranks, FSDP2 (every rank forwards the group's evaluation microbatches whole) or 2 pipeline
    stages (forward only through the stages, the last one's loss summed over the group): rank 1 of group 1
    dies after its first evaluation microbatch, its group leaves, group 0 computes the rest."""
    run = [*RUN[RUN.index("--steps"):], "--replicas", "2", "--parallel.group_size=2", "--eval.microbatches=5",
           *(["--parallel.pp=2"] if layout == "pp" else [])]
    run[run.index("--steps") + 1] = "4"
    ref, faulty = side_by_side(
        lambda: unbroken("train", *run, "--out", str(tmp_path / "ref")),
        lambda: unbroken("train", *run, "--faults", "kill:replica=1,rank=1,step=1,phase=eval",
                         "--out", str(tmp_path / "kill")))
    assert ref.returncode == 0 and faulty.returncode == 0, (ref.stderr[-1500:], faulty.stderr[-1500:])
    fired = [e for e in read_events(tmp_path / "kill") if e["event"] == "fault"]
    assert [(e["replica"], e.get("rank"), e["step"], e["phase"]) for e in fired] == [(1, 1, 1, "eval")]
    a, b = evals(tmp_path / "ref"), evals(tmp_path / "kill")
    assert sorted(a) == sorted(b) == [1, 3] and [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert a[1]["owners"] == {"0": [0, 2, 4], "1": [1, 3]} and b[1]["owners"] == {"0": [0, 2, 3, 4], "1": [1]}
    ra, rb = steps(read_events(tmp_path / "ref")), steps(read_events(tmp_path / "kill"))
    assert [ra[s]["param_digest"] for s in range(4)] == [rb[s]["param_digest"] for s in range(4)]


def test_bad_eval_settings_are_refused_in_one_line(tmp_path):
    cases = [(["--eval.every=2"], "eval.every=2 needs held-out data"),
             (["--eval.every=2", "--eval.split=0.1", "--parallel.group_size=2", "--parallel.on_rank_loss=replan"],
              "a shrunk group does not evaluate yet"),
             (["--eval.every=2", "--eval.path=" + str(tmp_path / "none.bin")], "eval.path="),
             (["--eval.split=1.5"], "eval.split=1.5: must be in [0, 1)")]
    results = side_by_side(*(lambda extra=extra: unbroken("train", "--steps", "2", *extra, "--out", str(tmp_path / "x"))
                             for extra, _ in cases))
    for (extra, words), r in zip(cases, results):
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
