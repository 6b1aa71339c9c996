"""RankRole: the step loop's view of a rank, derived from the topology like torchtitan's ParallelDims."""
from __future__ import annotations

import dataclasses

import pytest

from unbroken.runtime.trainer.role import RankRole
from unbroken.topology import Identity, Topology


def test_a_one_rank_group_holds_its_own_shard_and_counts_its_loss():
    role = RankRole.of(Topology(groups=3), Identity(group=2, rank=0, group_size=1, node=0), grouped=False)
    assert (role.holds, role.indices, role.timed, role.computes, role.fsdp, role.counts_loss) == \
        ((0,), 1, 1, (0,), False, True)
    assert role.tag == {} and role.shard_tag(0) == {} and not role.standin and not role.shrinkable


def test_fsdp2_ranks_compute_their_rows_and_time_for_the_group():
    topo = Topology(groups=2, group_size=2)
    roles = [RankRole.of(topo, Identity(0, r, 2, 0), grouped=True, replan=True) for r in range(2)]
    assert [r.share for r in roles] == [0, 1] and all(r.fsdp and r.shares == 2 for r in roles)
    assert [r.computes for r in roles] == [(0,), (1,)] and all(r.timed == 2 and r.indices == 2 for r in roles)
    assert roles[1].tag == {"rank": 1} and all(r.shrinkable for r in roles)


def test_tensor_parallel_ranks_count_the_loss_once():
    topo = Topology(groups=2, group_size=2, tp=2)
    roles = [RankRole.of(topo, Identity(0, r, 2, 0), grouped=True) for r in range(2)]
    assert [r.counts_loss for r in roles] == [True, False]
    assert not any(r.fsdp for r in roles) and [r.share for r in roles] == [0, 0]


def test_pipeline_stages_of_fsdp_shards_lay_out_tp_innermost():
    topo = Topology(groups=2, group_size=8, pp=2, tp=2)  # dp_shard 2
    role = RankRole.of(topo, Identity(1, 5, 8, 0), grouped=True)  # stage 1, shard 0, TP index 1
    assert (role.share, role.counts_loss, role.fsdp, role.holds) == (0, False, True, (5,))


def test_a_standin_holds_every_index_computes_every_share_and_names_each_shard():
    topo = Topology(groups=2, group_size=4)  # 4 FSDP2 shards
    role = RankRole.of(topo, Identity(0, 0, 4, 0), grouped=False, held=(0, 1, 2, 3), standin_shares=4,
                       replan=True)
    assert role.standin and not role.fsdp and role.counts_loss and not role.shrinkable
    assert role.computes == (0, 1, 2, 3) and role.timed == 1 and role.indices == 4
    assert role.tag == {"rank": 0, "shards": [0, 1, 2, 3]} and role.shard_tag(2) == {"rank": 2}


def test_the_role_is_a_frozen_value():
    role = RankRole.of(Topology(groups=1), Identity(0, 0, 1, 0), grouped=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.rank = 1  # type: ignore[misc]
