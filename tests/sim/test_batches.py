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
