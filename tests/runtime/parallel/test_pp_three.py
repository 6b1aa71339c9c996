"""Pipelines of three stages: the only layout with a middle stage, one that holds neither the embeddings nor
the head (the tied weight), so it adds zeros where the first and last stages sum the tied weight's parts.
2 groups, each a real `torchrun` job of the local launcher, a GPT of 3 blocks (one a stage), `--exact`,
dropout 0 (stages draw their masks per stage: test_pp_tp.py says why):
  pp=3          bitwise the one-rank run and the plain-PyTorch oracle cut into three stages; its middle
                stage killed mid-pipeline takes its group out, the survivors redo its microbatches through
                their own three stages, and every step's digest is the failure-free run's; under
                `--parallel.on_rank_loss=replan` the group goes on shrunk onto one survivor holding all
                three stages (standin.py), each healed from the matching rank of the live group, bitwise;
  pp=3 x FSDP2  (group_size 6: the (pp, dp_shard) mesh) within float32 tolerance of the one-rank run (the
                tied weight's per-stage batch sums, the middle stage's zeros included: pipeline.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.trainer.test_groups import assert_group_left, digests, run_faults
from tests.runtime.parallel.test_pp_tp import COMMON, assert_stages_bitwise, train
from tests.runtime.trainer.test_shrink import HOLD, one, stand_in_heals
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# 4 microbatches over 2 groups: quotas of 2, fewer than the 3 stages (GPipe), and 4 when one group is left
# (1F1B: one microbatch a stage at least)
# 16 steps: room for the shrink (the kill at step 2, the survivor's heal a few steps later under load)
THREE = [*COMMON, "--model.n_layer=3", "--microbatches", "4", "--steps", str(N := 16)]
STAGES = [*THREE, "--parallel.group_size=3", "--parallel.pp=3"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "one-rank", THREE)


@pytest.fixture(scope="module")
def three_stages(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "three-stages", STAGES)


def test_three_stages_are_bitwise_the_one_rank_run_and_the_oracle(three_stages, one_rank):
    """At every step the 3-stage run's digest is the oracle's cut into three stages, and its loss the
    one-rank run's, the same float; all three ranks computed every microbatch of their group's quota."""
    cfg = assert_stages_bitwise(three_stages, one_rank, 3)
    assert cfg.model.n_layer == 3  # a block a stage

def test_the_middle_stage_killed_takes_its_group_out_and_the_survivors_stay_on_the_trajectory(
        tmp_path, three_stages):
    """Rank 1 (the middle stage) of group 1 is SIGKILLed after its first forward of step 1: the coordinator
    removes group 1, group 0 redoes its microbatches through its three stages (all four in one schedule),
    and every step's digest equals the failure-free run's."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=1,phase=compute", base=STAGES)
    assert_group_left(events, 1, 1, 1, "compute")
    record = steps(events)
    assert record[1]["members"] == [0] and record[1]["ranks"] == 3
    assert sorted(record[1]["owners"]["0"]) == [0, 1, 2, 3]
    recovery = [e for e in events if e["event"] == "recovery" and e["step"] == 1 and e["replica"] == 0]
    assert sorted(e["rank"] for e in recovery) == [0, 1, 2], recovery
    assert digests(out) == digests(three_stages)


def test_three_stages_sharded_with_fsdp2_stay_within_float32_tolerance(tmp_path_factory, one_rank):
    """group_size 6 = 3 stages x 2 FSDP shards: every step's loss within 1e-5 (relative; measured 7.5e-7
    at most over 16 steps) of the one-rank run's, with the same owners; each of a stage's two shards
    computed its rows of every microbatch of its group's quota."""
    out = train(tmp_path_factory, "three-stages-fsdp", [*THREE, "--parallel.group_size=6", "--parallel.pp=3"])
    grid, dp = steps(read_events(out)), steps(read_events(one_rank))
    assert sorted(grid) == sorted(dp) == list(range(N))
    for s in dp:
        assert abs(grid[s]["loss"] - dp[s]["loss"]) <= 1e-5 * abs(dp[s]["loss"]), (s, grid[s]["loss"], dp[s]["loss"])
        assert grid[s]["owners"] == dp[s]["owners"] and grid[s]["ranks"] == 12
    rows = {(e["replica"], e["rank"], e["microbatch"]): e["tokens"] for e in read_events(out)
            if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in grid[0]["owners"].items()}
    assert set(rows) == {(g, j, i) for g, mbs in owners.items() for i in mbs for j in range(6)}
    assert len(set(rows.values())) == 1  # every rank its shard's half of a microbatch: 2 rows of 64 tokens



@pytest.mark.alone  # as test_shrink.py's: the heal must land with shrunk steps left
def test_a_lost_middle_stage_s_two_survivors_re_form_a_two_stage_pipeline_bitwise(tmp_path, three_stages):
    """The middle stage of group 1 is SIGKILLed in step 2's compute; its two survivors (stages 0 and 2)
    both claim, and the scheduler re-forms them into a pipeline of 2 stages that merge whole stages of the
    full plan (trainer/replan_reform.py): one holds two of the three stages' shard indices, the other the third. Each
    heals its indices from the matching ranks of group 0, the two run their quotas through a new process
    group among them, and every step's digest is the failure-free 3-stage run's."""
    replan = [*STAGES, "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1",
              "--coord.progress_timeout=120"]  # HOLD sleeps: no test here is about a hang
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=2,phase=compute; {HOLD}", base=replan)
    fault = one(events, "fault", kind="kill", replica=1, rank=1)
    assert (fault["step"], fault["phase"]) == (2, "compute")
    dead = one(events, "member_dead", replica=1)
    assert one(events, "join", replica=1, shrunk=True)["epoch"] > dead["epoch"]
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert plan["alive"] == [0, 2] and plan["trajectory"].startswith("bitwise")
    assert (plan["decision"], plan["applied"]) == ("shrink", "shrink") and plan["applied_teams"] == [[0], [2]], plan
    assert plan["applied_plan"] in ("tp1 pp2 [2,1]", "tp1 pp2 [1,2]") and not plan["not_executable"]
    regroups = [e for e in events if e["event"] == "regroup" and e["replica"] == 1]
    assert sorted(tuple(e["shards"]) for e in regroups) in ([(0,), (1, 2)], [(0, 1), (2,)]), regroups
    assert not [e for e in events if e["event"] == "survivor_left" and e["replica"] == 1]
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == [0, 1, 2] and len({e["donor"] for e in heals}) == 1
    healed = heals[0]["step"]
    computed = {tuple(e["shards"]) for e in events if e["event"] == "compute" and e["replica"] == 1
                and e["step"] > healed}
    assert computed in ({(0, 1), (2,)}, {(0,), (1, 2)}), computed
    assert digests(out) == digests(three_stages)
