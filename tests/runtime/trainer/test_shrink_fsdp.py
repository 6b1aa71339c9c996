"""Re-planning an FSDP2 group at run time (`--parallel.on_rank_loss=replan`): 2 groups of 2 FSDP2 shards
(HSDP), each rank a real torchrun agent of its own, in `--exact`. A rank of group 1 is SIGKILLed; its
group leaves the step and group 0 redoes its microbatches; the coordinator's scheduler prices shrinking
the group onto its survivor (the whole model on one rank, at about half the pair's speed) against
dropping it, and shrinks. The survivor heals both shard indices (each shard's rows of every parameter
and its Adam moments) from group 0's matching ranks, computes each shard's rows of every microbatch in
turn, and reduces each shard index with group 0's rank of that index: every step's digest is the
failure-free run's, dropout on. A replacement for the lost host then grows the group back to its two
shards, still on the plain one-process loop's trajectory. A group of 2 stages x 2 FSDP2 shards that
loses a rank of its second stage re-forms a pipeline of one rank a stage (trainer/replan_reform.py), each rank holding
both shards of its stage, bitwise; a group of all three degrees (2 stages x 2 FSDP2 shards x TP 2)
re-forms a pipeline of two TP teams, each rank holding both shards of its TP index's part of its stage,
bitwise.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.trainer.test_groups import digests, run_faults
from tests.runtime.parallel.test_pp_tp import train
from tests.runtime.trainer.test_shrink import GROW, HOLD, PIPELINE, STRETCH, assert_grown_back, assert_measured, \
    assert_ranks_counted, assert_stood_in, one, stand_in_heals
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HSDP = [a for a in PIPELINE if a != "--parallel.pp=2"]  # group_size 2, pp 1, tp 1: 2 FSDP2 shards a group
REPLAN = [*HSDP, "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1"]


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "hsdp-reference", HSDP)


# alone, as test_shrink's shrink tests: the windows they time (the heal before the run's end, quotas
# published while shrunk) are those of a quiet host
@pytest.mark.alone
@pytest.mark.parametrize("phase,rank", [("compute", 1), ("optimizer", 0)])
def test_an_fsdp2_group_that_lost_a_rank_goes_on_shrunk_on_its_survivor_bitwise(tmp_path, hsdp_reference,
                                                                                  phase, rank):
    out, events = run_faults(tmp_path, f"kill:replica=1,rank={rank},step=3,phase={phase}; {HOLD}", base=REPLAN)
    fault = one(events, "fault", kind="kill", replica=1, rank=rank)
    assert (fault["step"], fault["phase"]) == (3, phase)
    survivor = 1 - rank
    one(events, "group_broken", replica=1, rank=survivor)  # its FSDP2 collective found the peer gone
    released = one(events, "released", replica=1, rank=survivor)  # its shards went before the whole model
    assert (released["parameters"], released["elements"]) == (0, 0), released
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["decision"], plan["applied"], plan["alive"], plan["plan"]) == ("shrink", "shrink", [survivor],
                                                                               "tp1 pp1 [2]")
    assert plan["trajectory"].startswith("bitwise") and 0.4 < plan["applied_weight"] < 0.6  # half the pair
    heals = assert_stood_in(events, [0, 1])  # one process, both shards' rows
    assert_measured(events, "rank lost", heals)
    assert digests(out) == digests(hsdp_reference)  # on the failure-free HSDP trajectory, every step


def test_a_replaced_host_grows_the_shrunk_fsdp2_group_back_to_its_two_shards(tmp_path):
    """Rank 1 of group 1 dies with its host at step 3; group 1 goes on shrunk on rank 0; 6 s after the
    lost agent ended the launcher starts a replacement, whose rendezvous restarts the survivor: group 1
    re-forms at its full plan (2 FSDP2 shards), healed shard by shard from group 0, and every step's digest
    is the plain one-process loop's, each microbatch's rows split as the shards split them (dropout 0)."""
    base = [a for a in GROW if a != "--parallel.pp=2"]
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=3,phase=compute;{STRETCH}", base=base)
    one(events, "fault", kind="kill", replica=1, rank=1)
    assert one(events, "group_plan", replica=1, why="rank lost")["applied"] == "shrink"
    shrunk = one(events, "join", replica=1, shrunk=True)
    one(events, "agent_replaced", replica=1, slot=1)
    dead = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    assert len(dead) == 2 and dead[1]["epoch"] > shrunk["epoch"]  # the loss, then the stand-in's restart
    assert_grown_back(events, out, dead, full="tp1 pp1 [2] fsdp2")


# 2 groups of 8 ranks, torchtitan's (pp, dp_shard, tp) mesh: 2 stages x 2 FSDP2 shards x TP 2
THREE_D = ["--replicas", "2", "--steps", "8", "--microbatches", "12", "--exact", "--run.progress=false",
           "--coord.heartbeat_timeout=4.0", "--coord.heartbeat_interval=0.2", "--coord.run_timeout=270",
           "--coord.progress_timeout=200", "--model.dropout=0", "--parallel.group_size=8", "--parallel.pp=2",
           "--parallel.tp=2", "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1"]


@pytest.mark.timeout(420)
def test_a_3d_group_re_forms_a_pipeline_of_tp_teams_bitwise(tmp_path, tmp_path_factory):
    """2 groups of 8 ranks, 2 stages x 2 FSDP2 shards x TP 2 (rank = (stage x 2 + shard) x 2 + TP index):
    rank 5 (stage 1, shard 0, TP index 1) of group 1 dies with its host at step 2. Two whole TP teams of
    survivors re-form a pipeline, one team a stage (trainer/replan_reform.py; the other survivors leave): TP rank t of a
    team holds both FSDP2 shard indices of its stage's TP index t (FSDP2's rows of its local TP tensors),
    heals each from group 0's matching rank, computes each shard's rows of every microbatch in turn
    through TP over its team, and reduces each index with group 0's rank of it. Every step's digest is
    the failure-free 3-D run's: the TP degree is kept (the same kernels), each index sums in float64 the
    float32 gradients its FSDP2 rank's reduce-scatter summed, and the stages hand the tied weight's parts
    over apart. 12 microbatches a step: the re-formed group is priced at about 1/2 of the group and takes
    4 of them to group 0's 8 (amortised 0.22 s a step against dropping's 0.28, measured alone); with 4 a
    shrunk group's microbatch would outlast group 0's whole step. It was 48: the run and its reference
    took 273 CPU-s of the suite's ~1700 (176 s on one worker); at 12, 85 CPU-s and 64 s alone. Group 0
    sleeps 1 s after each of its steps from step 3 (a pipeline's compute span is its step) so the heal
    lands with steps left."""
    reference = train(tmp_path_factory, "three-d-reference", THREE_D)
    out, events = run_faults(tmp_path, "kill:replica=1,rank=5,step=2,phase=compute; slow:replica=0,from=3,for=1.0",
                             base=THREE_D)
    fault = one(events, "fault", kind="kill", replica=1, rank=5)
    assert (fault["step"], fault["phase"]) == (2, "compute")
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["applied"], plan["applied_plan"], plan["trajectory"][:7]) == ("shrink", "tp2 pp2 [1,1]", "bitwise"), plan
    teams = plan["applied_teams"]
    assert all(len(team) == 2 and team[0] % 2 == 0 and team[1] == team[0] + 1 for team in teams), teams  # TP teams
    assert set(r for team in teams for r in team) <= set(plan["alive"]) and not plan["not_executable"], plan
    regroups = sorted((e["stages"], e["tp"], tuple(e["shards"])) for e in events if e["event"] == "regroup"
                      and e["replica"] == 1)
    # stage k's team, TP index t: the indices (k x 2 + f) x 2 + t of both FSDP2 shards f
    assert regroups == [(2, 2, ((k * 2) * 2 + t, (k * 2 + 1) * 2 + t)) for k in (0, 1) for t in (0, 1)], regroups
    shrunk = {tuple(e["shards"]) for e in events if e["event"] == "compute" and e["replica"] == 1 and "shards" in e}
    assert shrunk == {shards for _, _, shards in regroups}, shrunk
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == list(range(8))
    records = {e["step"]: e for e in events if e["event"] == "step"}
    assert any("1" in records[s]["owners"] for s in range(max(e["step"] for e in heals) + 1, 8))
    # the step records count the re-formed group's 4 ranks, not its plan's 8
    join = one(events, "join", replica=1, shrunk=True)
    assert_ranks_counted(records, join["epoch"], 1 << 30, full=8, shrunk_ranks=4)
    assert digests(out) == digests(reference)


# 2 groups of 4 ranks: 2 stages x 2 FSDP2 shards (rank = stage x 2 + shard)
PP_FSDP = [*[a if a != "--parallel.group_size=2" else "--parallel.group_size=4" for a in PIPELINE],
           "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1"]


@pytest.mark.alone  # as test_shrink.py's: the heal must land with shrunk steps left
@pytest.mark.timeout(240)
def test_a_pipeline_of_fsdp2_stages_re_forms_one_rank_a_stage_bitwise(tmp_path, tmp_path_factory):
    """Rank 3 (stage 1, shard 1) of group 1 dies with its host in step 2's compute. Its survivors claim,
    and the scheduler re-forms a pipeline of 2 ranks, one a stage (any two survivors: each heals what it
    holds, and the scheduler weighs what each must pull), each holding both FSDP2 shard indices of its
    stage (the whole stage, not sharded) and computing each shard's rows of every microbatch in turn
    through the new group's pipeline. Each heals
    its two indices from group 0's matching ranks and reduces each with them. Every step's digest is the
    failure-free run's of the same topology, dropout on (each share's rows re-seeded per microbatch, as
    each shard's rank seeds them): each shard index sums in float64 the same float32 gradients its FSDP2
    rank summed, the tied weight's two uses included (the stages hand their parts over apart, as the
    full plan's stages added them in float64: pipeline.Stages(apart=True)). Measured before the stages
    handed them over apart (summed in float32 per microbatch): digests off from the first re-formed
    step, losses within 3.4e-8."""
    reference = train(tmp_path_factory, "pp-fsdp-reference", PP_FSDP)
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=3,step=2,phase=compute; {HOLD}", base=PP_FSDP)
    fault = one(events, "fault", kind="kill", replica=1, rank=3)
    assert (fault["step"], fault["phase"]) == (2, "compute")
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["decision"], plan["applied"], plan["applied_plan"]) == ("shrink", "shrink", "tp1 pp2 [1,1]"), plan
    (first,), (second,) = plan["applied_teams"]
    assert first != second and {first, second} <= set(plan["alive"]) <= {0, 1, 2}, plan  # any survivor: healed
    assert plan["trajectory"].startswith("bitwise")
    assert "shrink tp1 pp2 [1,1]" not in plan["not_executable"], plan["not_executable"]
    regroups = {tuple(e["shards"]) for e in events if e["event"] == "regroup" and e["replica"] == 1}
    assert regroups == {(0, 1), (2, 3)}, regroups
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == [0, 1, 2, 3]
    healed = max(e["step"] for e in heals)
    computed = {tuple(e["shards"]) for e in events if e["event"] == "compute" and e["replica"] == 1
                and e["step"] > healed}
    assert computed == regroups, computed
    records = {e["step"]: e for e in events if e["event"] == "step"}
    assert any("1" in records[s]["owners"] for s in range(healed + 1, 16))
    assert [records[s]["loss"] for s in range(16)] == [steps(read_events(reference))[s]["loss"] for s in range(16)]
    assert digests(out) == digests(reference)
