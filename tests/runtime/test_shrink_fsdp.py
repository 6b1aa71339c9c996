"""Re-planning an FSDP2 group at run time (`--parallel.on_rank_loss=replan`): 2 groups of 2 FSDP2 shards
(HSDP), each rank a real torchrun agent of its own, in `--exact`. A rank of group 1 is SIGKILLed; its
group leaves the step and group 0 redoes its microbatches; the coordinator's scheduler prices shrinking
the group onto its survivor (the whole model on one rank, at about half the pair's speed) against
dropping it, and shrinks. The survivor heals both shard indices (each shard's rows of every parameter
and its Adam moments) from group 0's matching ranks, computes each shard's rows of every microbatch in
turn, and reduces each shard index with group 0's rank of that index: every step's digest is the
failure-free run's, dropout on. A replacement for the lost host then grows the group back to its two
shards, still on the plain one-process loop's trajectory. A group of all three degrees (2 stages x 2
FSDP2 shards x TP 2) shrinks onto one survivor the same way, within float32 tolerance.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_groups import digests, run_faults
from tests.runtime.test_pp_tp import train
from tests.runtime.test_shrink import GROW, HOLD, PIPELINE, STRETCH, assert_grown_back, assert_measured, \
    assert_stood_in, one, shrinks_onto_one_survivor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HSDP = [a for a in PIPELINE if a != "--parallel.pp=2"]  # group_size 2, pp 1, tp 1: 2 FSDP2 shards a group
REPLAN = [*HSDP, "--parallel.on_rank_loss=replan", "--parallel.reform_seconds=0.1"]


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
    """Rank 1 of group 1 dies with its host at step 3; group 1 goes on shrunk on rank 0; 2.5 s after the
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
THREE_D = ["--replicas", "2", "--steps", "8", "--microbatches", "48", "--exact", "--run.progress=false",
           "--coord.heartbeat_timeout=4.0", "--coord.heartbeat_interval=0.2", "--coord.run_timeout=270",
           "--coord.progress_timeout=200", "--model.dropout=0", "--parallel.group_size=8", "--parallel.pp=2",
           "--parallel.tp=2", "--parallel.on_rank_loss=replan", "--parallel.reform_seconds=0.1"]


@pytest.mark.timeout(300)
def test_a_3d_group_shrinks_onto_one_survivor_within_float32_tolerance(tmp_path):
    """2 groups of 8 ranks, 2 stages x 2 FSDP2 shards x TP 2 (rank = (stage x 2 + shard) x 2 + TP index):
    rank 5 (stage 1, shard 0, TP index 1) of group 1 dies with its host at step 2. One survivor stands in
    for all 8 shard indices (the other six leave or are fenced): it heals each index's part from group
    0's matching rank (a stage's parameters, a TP rank's rows or columns of them, FSDP2's rows of that:
    2-D pieces where FSDP2 cuts a TP rank's columns, checked against real ranks' tensors in
    test_standin.py), computes each FSDP2 shard's rows in turn, and files each share's loss under its
    last stage's shard index. Not bitwise (TP 2 -> 1 reorders float32 sums; the tied weight is summed
    over stages per batch in float64 there, per microbatch in float32 here), and its `group_plan` says
    so: every step's loss within 1e-5 (relative) of the plain one-process loop's (measured alone: 2.6e-8,
    87 s). 48 microbatches a step: the one survivor is priced at 1/8 of the group, and with 4 the
    scheduler rightly drops the group (a microbatch of 8 units there would outlast group 0's whole
    step; measured: shrink 0.125 s a step against drop 0.078 s). Group 0 sleeps 1 s after each of its
    steps from step 3 (a pipeline's compute span is its step) so the heal lands with steps left."""
    shrinks_onto_one_survivor(tmp_path, THREE_D, hold="slow:replica=0,from=3,for=1.0", ranks=8, lost=5, at=2,
                             steps=8)
