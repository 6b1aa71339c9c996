"""The built-in Llama and the parallel plans, in one process: grouped-query attention groups the heads as
Llama's repeat_kv does, a tied head shares the embedding, the plan's pipeline split cuts the forward
into stages that compose to the whole model's bits, FSDP2 makes one unit per block plus the root, a TP
rank's slices cover each parameter once, and what a plan cannot do is one line before anything starts
(config, the Python API with a user's model)."""
from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from unbroken.config import ConfigError, ModelConfig, build
from unbroken.model.llama import Llama, ffn_width
from unbroken.model.builtin import check
from unbroken.model.plan import ParallelPlan, problems
from unbroken.runtime.parallel.pipeline import split, stage_names
from unbroken.runtime.parallel.standin import layout

pytestmark = pytest.mark.timeout(60)

CFG = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64)


def tokens(seed: int = 0, rows: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (rows, t), generator=torch.Generator().manual_seed(seed))


def test_grouped_query_attention_is_full_attention_with_each_kv_head_shared_by_its_group():
    """n_kv_head=2 of 4 heads: the same logits as a 4-kv-head model whose k and v heads 2g and 2g+1 are
    copies of the grouped model's head g (Llama's repeat_kv order)."""
    torch.manual_seed(0)
    grouped = Llama(CFG)
    full = Llama(replace(CFG, n_kv_head=0))
    state = grouped.state_dict()
    d = CFG.n_embd // CFG.n_head
    for key, value in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[key] = value.view(2, d, -1).repeat_interleave(2, dim=0).reshape(4 * d, -1)
    full.load_state_dict(state)
    x = tokens()
    assert torch.allclose(grouped(x), full(x), atol=1e-6, rtol=0)
    assert grouped.layers["0"].attention.wk.weight.shape == (2 * d, CFG.n_embd)


def test_a_tied_head_shares_the_embedding_and_an_untied_one_does_not():
    tied, untied = Llama(replace(CFG, tie_embeddings=True)), Llama(CFG)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert tied.no_weight_decay() == {"tok_embeddings.weight", "output.weight"}
    assert ffn_width(CFG) == 256 and ffn_width(replace(CFG, intermediate_size=96)) == 96


@pytest.mark.parametrize("tie", [False, True])
def test_the_plan_s_pipeline_stages_compose_to_the_whole_model_bit_for_bit(tie):
    """Stage 0 (embeddings, layer 0) then stage 1 (layer 1, norm, head): the whole model's loss, the same
    bits; each stage keeps its parameters' names; a tied head is found as tied across the stages."""
    torch.manual_seed(1)
    model = Llama(replace(CFG, tie_embeddings=tie))
    x, y = tokens(1), tokens(2)
    first, tied = split(copy.deepcopy(model), 0, 2)
    last, _ = split(copy.deepcopy(model), 1, 2)
    assert torch.equal(model.loss(last(first(x)), y), model(x, y))
    assert [n for n, _ in first.named_parameters()] == stage_names(model, 0, 2)
    assert sorted(n for n, _ in last.named_parameters()) == sorted(stage_names(model, 1, 2))
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    assert [names for names, _ in tied] == ([("tok_embeddings.weight", "output.weight")] if tie else [])


def test_a_tp_rank_s_slices_cover_every_parameter_once():
    """The stand-in's layout of 2 TP ranks (what a shrunk TP group computes with): column-wise layers split
    by rows, row-wise ones by columns, the norms, embeddings and head whole on both."""
    model = Llama(CFG)
    ranks = layout(model, tp=2)
    names = [n for n, _ in model.named_parameters()]
    for name, s0, s1 in zip(names, *ranks):
        if any(name.endswith(f"{w}.weight") for w in ("wq", "wk", "wv", "w1", "w3")):
            assert (s0.dim, s0.index.tolist(), s1.index.tolist()) == (
                0, list(range(s0.param.shape[0] // 2)), list(range(s0.param.shape[0] // 2, s0.param.shape[0])))
        elif name.endswith(("wo.weight", "w2.weight")):
            assert s0.dim == s1.dim == 1 and len(s0.index) + len(s1.index) == s0.param.shape[1]
        else:
            assert s0.whole and s1.whole, name


def test_fsdp2_makes_one_unit_per_block_then_the_root():
    """On a fake two-rank group (no peers): the plan's units, each a FSDPModule, in order, and the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.runtime.parallel.parallelize import _fully_shard
    from unbroken.runtime.parallel.precision import policy

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Llama(replace(CFG, n_layer=3))
        plan = model.parallel_plan()
        sharded = _fully_shard(model, plan, init_device_mesh("cpu", (2,)), policy("off", True))
        units = [name for name, m in sharded.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", "layers.0", "layers.1", "layers.2"]
    finally:
        dist.destroy_process_group()


def test_what_a_plan_cannot_do_is_one_line_each():
    model = Llama(CFG)
    plan = model.parallel_plan()
    assert problems(model, plan, tp=2, pp=2) == []
    assert problems(model, plan, tp=4) == ["parallel.tp=4 does not divide model.n_kv_head=2 (each TP rank takes "
                                          "whole ones)"]
    assert problems(model, plan, pp=3) == ["parallel.pp=3: more stages than the model's 2 layers"]
    wrong = replace(plan, fsdp=(*plan.fsdp, "layers.7"))
    assert problems(model, wrong) == ["the model's parallel plan names module 'layers.7', which the model does "
                                      "not have"]
    plain = nn.Sequential(nn.Linear(4, 4))
    assert problems(plain, ParallelPlan(), tp=2) == [
        "parallel.tp=2: the model's parallel plan has no tensor-parallel part"]
    assert "no pipeline part" in problems(plain, ParallelPlan(), pp=2)[0]


def test_bad_llama_degrees_are_refused_by_the_config_before_anything_starts():
    base = {"model.arch": "llama", "model.n_kv_head": "2", "parallel.group_size": "4"}
    with pytest.raises(ConfigError, match=r"^parallel.tp=4 does not divide model.n_kv_head=2"):
        build({}, {**base, "parallel.tp": "4"})
    with pytest.raises(ConfigError, match=r"^model.n_kv_head=3 does not divide model.n_head=4"):
        build({}, {**base, "model.n_kv_head": "3"})
    with pytest.raises(ConfigError, match=r"^parallel.pp=4: more stages than model.n_layer=2"):
        build({}, {**base, "parallel.pp": "4"})


def test_a_user_model_and_plan_are_checked_on_the_meta_device_before_any_worker():
    """`check` (api.check_host's): a user's model without a TP plan at parallel.tp=2, and a plan naming a
    module the model lacks, each one line; the built-in Llama's plan passes."""
    cfg = build({}, {"parallel.group_size": "2", "parallel.tp": "2"})
    with pytest.raises(ConfigError, match=r"^parallel.tp=2: the model's parallel plan has no tensor-parallel part$"):
        check(cfg, lambda c: nn.Sequential(nn.Linear(8, 8)))
    with pytest.raises(ConfigError, match=r"names module 'blocks.0'"):
        check(cfg, lambda c: Llama(replace(c.model, arch="llama")), ParallelPlan(fsdp=("blocks.0",)))
    check(replace(cfg, model=replace(cfg.model, arch="llama")))  # raises nothing


def test_document_positions_reach_the_rope_as_a_keyword_and_ranks_get_their_rows():
    """A Llama fed positions 0..T-1 is the Llama without them, bit for bit; positions restarting at a
    document boundary change the logits. The trainer hands a plan's inputs over as keywords, each a
    share's rows (model_inputs over data.part); a pipeline takes them too."""
    from unbroken.model.data import Microbatch, part
    from unbroken.runtime.trainer.stepwork import model_inputs

    torch.manual_seed(3)
    model = Llama(CFG)
    x = tokens(3)
    plain = torch.arange(16).expand(2, 16)
    assert torch.equal(model(x, positions=plain), model(x))
    restarted = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
    assert not torch.equal(model(x, positions=restarted), model(x))
    mb = Microbatch(x, x, 32, 512, restarted.clone())
    assert model_inputs(mb, (), torch.device("cpu")) == {}
    share = model_inputs(part(mb, 1, 2), ("positions",), torch.device("cpu"))
    assert list(share) == ["positions"] and torch.equal(share["positions"], restarted[1:])
    plan = replace(model.parallel_plan(), inputs=("positions",))
    assert problems(model, plan, pp=2) == []  # every stage gets them (tests/runtime/parallel/test_llama_groups.py)


def test_the_ignore_index_marks_padding_in_the_data_the_counts_and_the_loss():
    """data.ignore_index=-100 (Hugging Face's): variable-length rows are padded with -100, a rank's share
    counts its tokens without them, and the built-in models' losses leave them out (the same loss as
    -1 padding gives on the same rows)."""
    from unbroken.model.builtin import built_in
    from unbroken.model.data import DataSource, part

    cfg = build({}, {"data.seq_len": "8-64", "data.ignore_index": "-100", "model.arch": "llama"})
    mb = next(m for m in (DataSource(cfg.data, cfg.model.block_size, 0).microbatch(0, i) for i in range(20))
              if (m.y == -100).any())
    assert mb.ignore_index == -100 and mb.tokens == int((mb.y != -100).sum()) and not (mb.y == -1).any()
    halves = [part(mb, j, 2) for j in range(2)]
    assert sum(h.tokens for h in halves) == mb.tokens and all(h.ignore_index == -100 for h in halves)
    for arch in ("gpt", "llama"):
        torch.manual_seed(0)
        hf_style = built_in(replace(cfg.model, arch=arch, dropout=0.0), -100)
        torch.manual_seed(0)
        ours = built_in(replace(cfg.model, arch=arch, dropout=0.0), -1)
        assert torch.equal(hf_style(mb.x, mb.y), ours(mb.x, torch.where(mb.y == -100, -1, mb.y)))
    with pytest.raises(ConfigError, match=r"^data.ignore_index=3: must be"):
        build({}, {"data.ignore_index": "3"})


def test_a_user_s_parallelize_function_is_checked_after_it_runs():
    """parallelize(model, mesh, dims) on a fake 2-rank group: a function that shards only the blocks, or
    reduces in float32 under --exact, is one line; one that shards blocks and root as told gets every unit
    reducing a SUM (no divide factor). `describe` (a rank's `parallelized` event) reads its units, and a
    TP rank's split parameters, off the module."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.runtime.parallel.parallelize import _custom, _mesh, _tensor_parallel, describe
    from unbroken.runtime.parallel.precision import policy
    from unbroken.topology import Topology, TopologyError

    def blocks_only(model, mesh, dims):
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=dims["mp_policy"])
        return model

    def torchtitan(model, mesh, dims):
        return fully_shard(blocks_only(model, mesh, dims), mesh=mesh["dp_shard"], mp_policy=dims["mp_policy"])

    def float32(model, mesh, dims):
        return fully_shard(model, mesh=mesh["dp_shard"])

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        topology = Topology(2, 2)
        mesh = _mesh(topology, dist.group.WORLD, torch.device("cpu"))
        with pytest.raises(TopologyError, match=r"must fully_shard the model's root over mesh\['dp_shard'\]"):
            _custom(Llama(CFG), blocks_only, topology, mesh, policy("off", True))
        with pytest.raises(TopologyError, match=r"reduces in None, the run in torch.float64: pass mp_policy"):
            _custom(Llama(CFG), float32, topology, mesh, policy("off", True))
        model = _custom(Llama(CFG), torchtitan, topology, mesh, policy("off", True))
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == CFG.n_layer + 1
        groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
        assert all(g.force_sum_reduction_for_comms and g.gradient_divide_factor == 1.0 for g in groups)
        # what the rank's `parallelized` event reports of it, and of a TP rank of the Llama's plan
        assert describe(model, model.parallel_plan(), None) == {
            "fsdp_units": ["", "layers.0", "layers.1"], "tp_sharded": 0, "stage": None, "stack": ["0", "1"],
            "inputs": [], "compiled": 0}
        tp = Llama(CFG)
        _tensor_parallel(tp, tp.parallel_plan(), _mesh(Topology(1, 2, tp=2), dist.group.WORLD, torch.device("cpu")), 2)
        assert describe(tp, tp.parallel_plan(), None)["tp_sharded"] == 7 * CFG.n_layer  # wq wk wv wo w1 w2 w3
    finally:
        dist.destroy_process_group()


def test_what_a_parallelize_function_cannot_do_is_one_line_before_anything_starts():
    """Pipeline stages come from a plan: with a user's parallelize function they are refused by
    `check_host`, which `unbroken.train` runs before any process starts. Re-forming onto survivors cuts
    slices by the plan too: under parallel.on_rank_loss=replan check_host says why such groups cannot
    re-form (the coordinator then drops them: tests/runtime/coordinator/test_replanning.py), and nothing under drop."""
    from unbroken.api import CUSTOM_REFUSED, check_host
    fn = lambda model, mesh, dims: model  # noqa: E731
    with pytest.raises(ConfigError, match=r"^parallel.pp=2 with a parallelize function") as e:
        check_host(build({}, {"parallel.group_size": "2", "parallel.pp": "2"}), parallelize=fn)
    assert "\n" not in str(e.value)
    replan = build({}, {"parallel.group_size": "2", "parallel.on_rank_loss": "replan"})
    assert check_host(replan, parallelize=fn) == CUSTOM_REFUSED
    assert check_host(replan) is None and check_host(build({}, {"parallel.group_size": "2"}), parallelize=fn) is None


def test_a_tp_plan_whose_slices_a_survivor_cannot_cut_cannot_re_form():
    """reform_problem: the built-in plans re-form (the GPT's rewrite comes with its slicer, the Llama's
    styles are column- and row-wise on nn.Linear); a rewrite without a slicer, or a row-wise style on an
    embedding inside a layer (torch shards it along another dim than a Linear's), is one line, which
    `check` returns under parallel.on_rank_loss=replan for the coordinator."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from unbroken.model.gpt import GPT
    from unbroken.model.plan import TensorPlan, reform_problem

    gpt = GPT(replace(CFG, arch="gpt"))
    llama = Llama(CFG)
    assert reform_problem(gpt, gpt.parallel_plan(), tp=2) is None and reform_problem(llama, llama.parallel_plan(), 2) is None
    unsliced = replace(gpt.parallel_plan(), tp=replace(gpt.parallel_plan().tp, slicer=None))
    assert reform_problem(gpt, unsliced, tp=1) is None  # no TP: nothing to cut
    assert reform_problem(gpt, unsliced, tp=2).startswith("the model's TP plan rewrites its layers")

    class Tagged(nn.Module):  # a layer holding an embedding of its own
        def __init__(self):
            super().__init__()
            self.tags = nn.Embedding(8, 32)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": Tagged()})
    odd = ParallelPlan(stack="layers", tp=TensorPlan({"tags": RowwiseParallel()}))
    assert reform_problem(model, odd, tp=2) == ("the model's TP plan gives RowwiseParallel to 'tags' (Embedding) "
                                                "and no slicer: a survivor cannot cut a TP rank's part of it")
    cfg = build({}, {"parallel.group_size": "2", "parallel.tp": "2", "model.arch": "gpt"})
    unsliced_check = lambda c: check(c, None, unsliced)  # noqa: E731
    assert unsliced_check(cfg) is None  # on_rank_loss=drop: nothing to re-form
    replan = replace(cfg, parallel=replace(cfg.parallel, on_rank_loss="replan"))
    assert unsliced_check(replan).startswith("the model's TP plan rewrites its layers")
