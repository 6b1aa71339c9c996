"""A stand-in's layout (runtime/parallel/standin.py): which part of the whole model each shard index of a
pipeline of tensor-parallel stages holds. Pure tensor bookkeeping, no processes."""
from __future__ import annotations

import pytest
import torch

from unbroken.config import Config
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.pipeline import stage_names
from unbroken.runtime.parallel.standin import StandIn, tensor_layout

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
