"""Live recovery never changes the batch; drop-replica's batch shrinks exactly while replicas are out."""
from __future__ import annotations

import pytest

from unbroken.policy import workload
from unbroken.sim.runner import simulate


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", ["unbroken_live", "unbroken_detect"])
def test_live_recovery_keeps_every_microbatch(small, strategy):
    M = small.workload.microbatches
    recs = simulate(small, strategy, seed=5, log_steps=True, keep=True).records
    steps = [r for r in recs if r["event"] == "step"]
    assert steps and all(r["microbatches"] == M for r in steps)
    assert [r["step"] for r in steps] == list(range(len(steps)))
    dead = [r for r in recs if r["event"] == "member_dead"]
    redo = [r for r in recs if r["event"] == "recovery"]
    assert dead and redo
    # a recovered step's redone microbatches are exactly the dead replicas' share of that step's plan
    for step in {r["step"] for r in redo}:
        mbs = sorted(i for r in redo if r["step"] == step for i in r["redo"])
        assert len(mbs) == len(set(mbs)) and all(0 <= i < M for i in mbs)
    assert next(r for r in recs if r["event"] == "run_end")["steps_batch_differs"] == 0


@pytest.mark.timeout(30)
def test_drop_replica_batch_shrinks_exactly_while_out(small):
    M, R = small.workload.microbatches, small.cluster.dp
    share = workload.quotas(M, range(R))
    recs = simulate(small, "drop_replica", seed=5, log_steps=True, keep=True).records
    members = {0: list(range(R))}
    for r in recs:
        if r["event"] == "epoch":
            members[r["epoch"]] = r["members"]
    steps = [r for r in recs if r["event"] == "step"]
    shrunk = [r for r in steps if r["microbatches"] < M]
    assert shrunk and len(shrunk) < len(steps)
    for r in steps:
        assert r["microbatches"] == sum(share[m] for m in members[r["epoch"]])
        assert (r["microbatches"] < M) == (len(members[r["epoch"]]) < R)
    # replicas leave exactly when declared dead and come back exactly after replacement + rejoin
    outs = [r for r in recs if r["event"] == "member_dead"]
    epochs = [r for r in recs if r["event"] == "epoch"]
    for d in outs:
        later = [e for e in epochs if e["t"] >= d["t"]]
        assert d["replica"] not in later[0]["members"]


@pytest.mark.timeout(30)
def test_in_step_recovery_recovers_the_step_in_flight_and_commits_it_when_the_redo_ends():
    """A kill 8.5 steps into a stretch (nothing flushed the stretch before it): the fault and the
    recovery name step 8, and step 8 commits once its orphans are redone, not a full step after that
    (the stretch used to report the step of its last flush, 0, so its in-step recovery was thrown away
    and step 8 recomputed from scratch)."""
    from unbroken.sim.scenario import from_tree
    mb, sync, detect, reform = 0.02, 0.01, 0.05, 0.03
    step = 4 * mb + sync
    tree = {"name": "kill-mid-step", "cluster": {"dp": 2, "tp": 1, "pp": 1, "gpus_per_node": 1},
            "workload": {"microbatches": 8, "tokens_per_microbatch": 16, "microbatch_seconds": mb,
                         "sync_seconds": sync, "duration_hours": 5 / 3600},
            "costs": {"detect_seconds": detect, "reform_seconds": reform, "restart_seconds": 1.0,
                      "reload_seconds": 0.0, "checkpoint_seconds": 0.0, "snapshot_seconds": 0.0,
                      "memory_restore_seconds": 0.0, "rejoin_seconds": 0.0, "replace_seconds": float("inf")},
            "trace": [{"at_hours": 8.5 * step / 3600, "cause": "kill", "scope": "gpu"}]}
    recs = simulate(from_tree(tree, "kill-mid-step"), "unbroken_live", log_steps=True, keep=True).records
    fault = next(r for r in recs if r["event"] == "fault")
    assert fault["step"] == 8
    assert {r["step"] for r in recs if r["event"] == "recovery"} == {8}
    # the survivor's own 4 were done by 8.5 steps in; it waits for the verdict and the re-form, redoes 4
    t8 = next(r["t"] for r in recs if r["event"] == "step" and r["step"] == 8)
    assert t8 == pytest.approx(8.5 * step + detect + reform + 4 * mb + sync)
    assert [r["step"] for r in recs if r["event"] == "step"][:10] == list(range(10))
