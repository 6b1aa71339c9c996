"""A stand-in's layout (runtime/parallel/standin.py): which part of the whole model each shard index of a
pipeline of tensor-parallel stages holds. Pure tensor bookkeeping, no processes."""
from __future__ import annotations

import pytest
import torch

from unbroken.config import Config
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.pipeline import stage_names
from unbroken.runtime.parallel.standin import StandIn, tensor_layout
from unbroken.topology import TopologyError

pytestmark = pytest.mark.timeout(60)


def test_each_stage_s_tensor_parallel_slices_cover_its_parameters_once():
    """Shard index s x tp + t is TP rank t's part of stage s: over t, a stage's split parameters are cut
    into disjoint parts that cover every entry once, its other parameters held whole by every t; the
    stages hold their own names (the tied head on the last stage), in the order that stage lists them."""
    torch.manual_seed(0)
    model = GPT(Config().model)
    pp, tp = 2, 2
    layout = tensor_layout(model, tp, pp)
    assert len(layout) == pp * tp
    named = dict(model.named_parameters(remove_duplicate=False))
    for s in range(pp):
        names = stage_names(model, s, pp)
        for t in range(tp):
            assert [id(x.param) for x in layout[s * tp + t]] == [id(named[n]) for n in names]
        for i, n in enumerate(names):
            parts = [layout[s * tp + t][i] for t in range(tp)]
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
    assert (standin.count, standin.loss_shard) == (4, 2)  # the last stage's TP index 0, as its rank counts it


def test_fsdp2_shards_rows_are_torch_chunk_s_and_each_share_s_loss_goes_to_its_shard():
    """Shard index j holds torch.chunk(p, G)[j] of every parameter (what fully_shard leaves on rank j, the
    last chunk shorter where dim 0 does not divide), in named_parameters order; each share's loss is
    filed under its own shard index."""
    torch.manual_seed(0)
    model = GPT(Config().model)
    standin = StandIn(model, shards=3)
    params = [p for _, p in model.named_parameters()]
    assert standin.count == 3 and [len(shard) for shard in standin.layout] == [len(params)] * 3
    for j in range(3):
        for s, p in zip(standin.layout[j], params):
            assert s.param is p and torch.equal(s.take(p.detach()), torch.chunk(p.detach(), 3)[j])
    acc = standin.accumulator(torch.float64, params)
    acc.zero()
    for share in range(3):
        acc.add(torch.tensor(float(share + 1)), share)
    assert [float(a.buffer[-1]) for a in acc.parts] == [1.0, 2.0, 3.0]
    with pytest.raises(TopologyError, match="FSDP2 shards alone"):
        StandIn(model, pp=2, shards=2)
