"""Snapshots and checkpoints of pipeline and tensor-parallel replica groups (2 groups of 2 ranks, each a
real `torchrun` job of the local launcher, in `--exact`, dropout 0): a whole-job crash restores every
stage from the snapshot agents' memory, and a whole-job restart from disk loads every rank's part of a
DCP checkpoint (a stage's own parameters and optimizer state; a TP rank's DTensor slices; and in 2 groups
of 4 ranks, FSDP2 beside TP, each slice's FSDP shard of it, or FSDP2 inside the stages). Each run ends
on the failure-free trajectory of its topology, every step, and what each rank loaded is that
trajectory's state at the step it names.
"""
from __future__ import annotations

import hashlib

import pytest
import torch.distributed.checkpoint as dcp

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import committed_before, digests, longer, plain_loop, run_faults
from tests.runtime.parallel.test_pp_tp import BOTH, COMMON, PIPELINE, TENSOR, staged
from unbroken.config import Config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


GRID4 = [*COMMON, "--parallel.group_size=4", "--parallel.tp=2"]  # FSDP2 beside TP: rank = shard x 2 + TP index
STAGED4 = [*COMMON, "--parallel.group_size=4", "--parallel.pp=2"]  # FSDP2 in stages: rank = stage x 2 + shard


def restored_step(events: list[dict], source: str, ranks: int) -> tuple[int, str]:
    """(The one step every rank of both groups restored, the digest of a group's record at it: sha256 of
    its ranks' digests) after checking each restored from `source` and rank j's digest is the same in
    both groups."""
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["source"] == source, restart
    restored = [e for e in events if e["event"] == "restored"]
    assert sorted((e["replica"], e["rank"], e["source"]) for e in restored) == \
        [(g, j, source) for g in range(2) for j in range(ranks)], restored
    (step,) = {e["step"] for e in restored}
    shard = {j: {e["param_digest"] for e in restored if e["rank"] == j} for j in range(ranks)}
    assert all(len(d) == 1 for d in shard.values()), shard  # both groups loaded the same state per rank
    return step, hashlib.sha256("".join(next(iter(shard[j])) for j in range(ranks)).encode()).hexdigest()


def test_a_whole_job_crash_restores_every_pipeline_stage_from_memory(tmp_path):
    """Rank j of each group snapshots its stage into shard index j's family (2 nodes, one group each);
    every trainer is SIGKILLed in step 4, and every stage restores the newest step both families hold.
    The oracle is the plain one-process loop in stage layout (no unbroken code)."""
    args = longer(PIPELINE, 8)
    # The launcher fires crash-all once it sees step 3's record; a step takes ~50 ms, and under CI's load
    # step 4 once committed before the kill landed. Group 0 sleeps through 20x its step-4 compute (wall
    # time only: the arithmetic never sees it), so the kill lands inside step 4.
    out, events = run_faults(tmp_path, "crash-all:step=4; slow:replica=0,from=4,to=5,factor=20,how=sleep",
                             "--snapshot.enabled=true", "--snapshot.nodes=2", base=args)
    (crash,) = [e for e in events if e["event"] == "fault" and e.get("kind") == "crash-all"]
    assert crash["replicas"] == [0, 1], crash
    before = events.index(next(e for e in events if e["event"] == "restart"))
    assert 4 not in {e["step"] for e in events[:before] if e["event"] == "step"}  # the crash cost step 4
    step, loaded = restored_step(events, "memory", 2)
    cfg = Config.from_json((out / "config.json").read_text())
    want, _, _ = plain_loop(cfg, split=False, digest=staged(2))
    assert 0 <= step <= 3 and loaded == want[step]
    assert [digests(out)[s] for s in range(8)] == want


@pytest.mark.parametrize("layout", ["tp", "pp x tp", "fsdp x tp", "pp x fsdp"])
def test_a_restart_from_disk_loads_each_rank_s_part_of_the_dcp_checkpoint(tmp_path, layout):
    """A rank of group 1 killed in step 3 under `--run.recovery=restart-disk`: every trainer restarts and
    loads the newest complete DCP checkpoint (every step saved by group 0), and the run ends bitwise on
    the failure-free run of the same topology. The checkpoint holds each TP-split weight as the ranks'
    slices of one global tensor (DTensor), and a pipeline's stages under their own names."""
    # 6 steps: killed in the last of 4, the survivors could finish the run before the restart (CI at 9dfb30d)
    base = longer({"tp": TENSOR, "pp x tp": BOTH, "fsdp x tp": GRID4, "pp x fsdp": STAGED4}[layout], 6)
    reference = tmp_path / "reference"
    r = unbroken("train", *base, "--out", str(reference))
    assert r.returncode == 0, r.stderr[-2000:]
    # Step 3, not 2: a save is whole once the next save starts (it waits for the one before), and group 0
    # starts step 1's save before its step-2 all-reduce, which group 1 waits for before step 3; so step
    # 0's checkpoint is complete before the kill. Killed in step 2, step 0's async save raced the restart's
    # kills, and in CI at 3ae4c72 lost: no checkpoint was whole and every rank started from scratch.
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=3,phase=compute", "--checkpoint.every=1",
                             "--run.recovery=restart-disk", base=base)
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert (fault["replica"], fault["rank"], fault["step"]) == (1, 1, 3)
    ranks = 2 if layout == "tp" else 4
    step, loaded = restored_step(events, "disk", ranks)
    # group 0 may commit (and checkpoint) a step or two alone before the launcher's restart lands: CI at
    # ec470e9 loaded step 2, committed by group 0 after the kill, on the reference's digest
    committed = committed_before(events, next(e for e in events if e["event"] == "restart"))
    assert 0 <= step <= committed and loaded == digests(reference)[step], (step, committed)
    assert digests(out) == digests(reference)
    meta = dcp.FileSystemReader(str(out / "checkpoints" / f"step_{step:08d}")).read_metadata()
    split = meta.state_dict_metadata["param/blocks.0.mlp.0.weight"]  # rows split over TP ranks, FSDP shards or both
    chunks = sorted(tuple(c.offsets) for c in split.chunks)
    # and beside FSDP2, each TP slice's rows split again over the 2 shards: a quarter of the rows a rank;
    # FSDP2 alone inside a stage: half of them
    parts = 4 if layout == "fsdp x tp" else 2
    assert [c[0] for c in chunks] == [k * split.size[0] // parts for k in range(parts)], chunks
    if layout.startswith("pp"):  # stage 0 holds block 0, stage 1 block 1 and the head, each under its own name
        assert {"param/blocks.1.mlp.0.weight", "param/head.weight", "param/tok.weight"} <= \
            set(meta.state_dict_metadata)
        assert any(k.startswith("optim/blocks.1.") for k in meta.state_dict_metadata)
