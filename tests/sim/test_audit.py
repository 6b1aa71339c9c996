"""Every strategy commits exactly the steps and tokens it claims, and every GPU-hour is accounted for."""
from __future__ import annotations

import pytest

from unbroken.sim import audit as audit_mod
from unbroken.sim.audit import AuditError, audit
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import CONSTANT_BATCH, STRATEGIES


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("log_steps", [False, True])
def test_strategy_commits_what_it_claims(small, strategy, log_steps):
    res = simulate(small, strategy, seed=11, log_steps=log_steps, keep=True)
    traj = audit(res.records)
    assert len(traj.batches) == res.end["steps_committed"] > 0
    kinds = {r["event"] for r in res.records}
    assert "fault" in kinds
    if CONSTANT_BATCH[strategy]:
        assert set(traj.batches) == {small.workload.microbatches}
    if strategy == "checkpoint_restart":
        assert "rollback" in kinds  # this trace interrupts it between checkpoints


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["scenarios/recover_512.toml", "scenarios/resihp_256_mixed.toml"])
def test_shipped_scenarios_audit(path):
    sc = load(path)
    for strategy in STRATEGIES:
        audit(simulate(sc, strategy, seed=0, keep=True, aggregate_seconds=300).records)


@pytest.mark.timeout(20)
def test_audit_catches_a_missing_step(small):
    records = simulate(small, "unbroken_live", seed=1, log_steps=True, keep=True).records
    i = next(i for i, r in enumerate(records) if r["event"] == "step" and r["step"] == 5)
    with pytest.raises(AuditError, match="expected 5"):
        audit_mod.audit(records[:i] + records[i + 1:])
    tampered = [dict(r) for r in records]
    end = next(r for r in tampered if r["event"] == "run_end")
    end["tokens"] += 1000
    with pytest.raises(AuditError, match="tokens"):
        audit(tampered)
