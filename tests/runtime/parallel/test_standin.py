"""A stand-in's layout (runtime/parallel/standin.py): which part of the whole model each shard index of a
pipeline of tensor-parallel stages holds. Pure tensor bookkeeping, no processes."""
from __future__ import annotations

import pytest
import torch

from unbroken.config import Config
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.pipeline import stage_names
from unbroken.runtime.parallel.standin import StandIn, layout
from unbroken.topology import TopologyError

pytestmark = pytest.mark.timeout(60)


def test_each_stage_s_tensor_parallel_slices_cover_its_parameters_once():
    """Shard index s x tp + t is TP rank t's part of stage s: over t, a stage's split parameters are cut
    into disjoint parts that cover every entry once, its other parameters held whole by every t; the
    stages hold their own names (the tied head on the last stage), in the order that stage lists them."""
    torch.manual_seed(0)
    model = GPT(Config().model)
    pp, tp = 2, 2
    held = layout(model, pp, tp)
    assert len(held) == pp * tp
    named = dict(model.named_parameters(remove_duplicate=False))
    for s in range(pp):
        names = stage_names(model, s, pp)
        for t in range(tp):
            assert [id(x.param) for x in held[s * tp + t]] == [id(named[n]) for n in names]
        for i, n in enumerate(names):
            parts = [held[s * tp + t][i] for t in range(tp)]
            if parts[0].whole:
                assert all(p.whole for p in parts)
                continue
            seen = torch.zeros(named[n].shape[parts[0].dim], dtype=torch.int64)
            for p in parts:
                seen[p.index] += 1
            assert bool((seen == 1).all()), n  # each row (or column) in exactly one TP rank's part
    assert "head.weight" in stage_names(model, pp - 1, pp)


def test_the_stand_in_counts_every_shard_index_and_the_loss_once():
    torch.manual_seed(0)
    standin = StandIn(GPT(Config().model), pp=2, tp=2)
    assert (len(standin.held), standin.loss_shards) == (4, (2,))  # the last stage's TP index 0, as its rank counts it


def test_fsdp2_shards_rows_are_torch_chunk_s_and_each_share_s_loss_goes_to_its_shard():
    """Shard index j holds torch.chunk(p, G)[j] of every parameter (what fully_shard leaves on rank j, the
    last chunk shorter where dim 0 does not divide), in named_parameters order; each share's loss is
    filed under its own shard index."""
    torch.manual_seed(0)
    model = GPT(Config().model)
    standin = StandIn(model, shards=3)
    params = [p for _, p in model.named_parameters()]
    assert len(standin.held) == 3 and [len(shard) for shard in standin.layout] == [len(params)] * 3
    for j in range(3):
        for s, p in zip(standin.layout[j], params):
            assert s.param is p and torch.equal(s.take(p.detach()), torch.chunk(p.detach(), 3)[j])
    acc = standin.accumulator(torch.float64, params)
    acc.zero()
    for share in range(3):
        acc.add(torch.tensor(float(share + 1)), share)
    assert [float(a.buffer[-1]) for a in acc.parts] == [1.0, 2.0, 3.0]
    with pytest.raises(TopologyError, match="several ranks"):
        StandIn(model)


def _local_shards(rank: int, world: int, init: str, pp: int, tp: int, out: str) -> None:
    """One rank of a real group (gloo): the seeded model parallelized as the worker does it, its local
    tensors (`accumulator.local`, in `unique_parameters` order) saved for the parent to compare."""
    import torch.distributed as dist

    from unbroken.runtime.parallel.accumulator import local, unique_parameters
    from unbroken.runtime.parallel.parallelize import parallelize
    from unbroken.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model, _ = parallelize(GPT(Config().model), Topology(1, world, world, tp=tp, pp=pp), dist.group.WORLD,
                           rank=rank, shape=(2, 16))
    torch.save([local(p).detach().clone() for p in unique_parameters(model)], f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_layout_of_a_3d_group_is_each_rank_s_own_local_tensors(tmp_path, monkeypatch):
    """2 stages x 2 FSDP2 shards x TP 2 (8 real ranks, parallelize as the worker calls it): every shard
    index's slices of one whole model (the same seed) are, bit for bit and in order, the local tensors
    that rank holds: its stage's parameters, its TP part of each (qkv's heads reordered, row-wise
    columns) and FSDP2's chunk of that along dim 0 (2-D pieces where both cut one weight)."""
    import multiprocessing

    import torch.multiprocessing as mp

    pp, tp, world = 2, 2, 8
    # the 8 ranks fork from one server that imported this module and parallelize once (with one OpenMP
    # thread, as the launcher's fork server does: forking after OpenMP's pool started is unsafe), rather
    # than 8 fresh interpreters importing torch: 28 -> 10 CPU-s for the test alone (2 cores, pytest included)
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [__name__, "unbroken.runtime.parallel.parallelize"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's, read when it starts; the ranks set theirs anyway
    mp.start_processes(_local_shards, args=(world, f"file://{tmp_path}/rdzv", pp, tp, str(tmp_path)),
                       nprocs=world, start_method="forkserver")
    torch.manual_seed(0)
    standin = StandIn(GPT(Config().model), pp=pp, tp=tp, shards=world // (pp * tp))
    for rank in range(world):
        theirs = torch.load(tmp_path / f"{rank}.pt")
        ours = [s.take(s.param.detach()) for s in standin.layout[rank]]
        assert [t.shape for t in ours] == [t.shape for t in theirs], rank
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), rank
    assert standin.loss_shards == (4, 6)  # stage 1's TP index 0 of shard 0 and of shard 1
    # and `put` writes each part back where `take` read it: together the parts rebuild every parameter
    rebuilt = {id(p): torch.zeros_like(p) for p in standin.model.parameters()}
    for shard in standin.layout:
        for s in shard:
            s.put(rebuilt[id(s.param)], s.take(s.param.detach()))
    assert all(torch.equal(rebuilt[id(p)], p.detach()) for p in standin.model.parameters())


def test_a_stage_that_merges_full_stages_holds_their_names_and_only_their_shard_indices():
    """A group of 3 stages re-formed into 2 (its middle stage merged into the first): the merged stage
    keeps exactly the blocks of full stages 0 and 1 (and the embeddings), the other those of stage 2 (and
    the head); a partial stand-in on the merged stage holds shard indices 0 and 1, the parameters of
    those stages, and counts no loss (the last stage does); on the other, index 2 and the loss."""
    from unbroken.runtime.parallel.pipeline import merged_bounds, split

    from dataclasses import replace

    model_cfg = replace(Config().model, n_layer=6)
    torch.manual_seed(0)
    whole = GPT(model_cfg)
    merged = [range(0, 2), range(2, 3)]
    bounds = merged_bounds(whole, 3, merged)
    assert bounds == [0, 4, 6]
    with pytest.raises(TopologyError):
        merged_bounds(whole, 3, [range(0, 1), range(2, 3)])
    for k, held in enumerate(((0, 1), (2,))):
        torch.manual_seed(0)
        model = GPT(model_cfg)
        want = [n for j in held for n in stage_names(model, j, 3)]
        standin = StandIn(model, pp=3, held=held)
        model, _ = split(model, k, 2, bounds)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        got = [names[id(s.param)] for shard in standin.layout for s in shard]
        assert sorted(got) == sorted(want) and len(standin.layout) == len(held) == len(standin.held)
        assert set(names.values()) == set(want) | ({"head.weight"} if k == 1 else {"tok.weight"} - set(want))
        assert standin.loss_shards == ((0,) if k == 1 else ())


def test_a_survivor_s_stale_parameters_name_what_still_holds_them():
    """`released` (trainer/lifecycle.py) counts the parameters alive after a survivor let its stage go, and where
    there are some, names a chain of what holds one: here a thread's target. (Counted against what this
    test process held before: other tests' modules may live on in it.)"""
    import threading

    from unbroken.runtime.trainer.replan_reform import _holder, stale_parameters

    before = stale_parameters()
    done = threading.Event()

    class Job:  # a background job that keeps a module alive until it ends
        def __init__(self, module):
            self.module = module

        def run(self):
            done.wait(10)

    job = Job(torch.nn.Linear(3, 4))
    held = job.module.weight
    thread = threading.Thread(target=job.run, daemon=True)
    thread.start()
    del job
    try:
        stale = stale_parameters()
        assert (stale["parameters"] - before["parameters"], stale["elements"] - before["elements"]) == (2, 16)
        assert "held_by" in stale
        chain = _holder(held, ignore=[])
        assert chain.startswith("Parameter <- ") and "Linear <- Job <- method <- Thread" in chain, chain
    finally:
        done.set()
        thread.join()
    del held
    assert stale_parameters() == before
