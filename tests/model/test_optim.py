"""The schedule, the parameter groups and clipping of model/optim.py, as pure functions."""
from __future__ import annotations

import math

import pytest
import torch

from unbroken.config import ModelConfig, OptimConfig
from unbroken.model.gpt import GPT
from unbroken.model.optim import clip_whole, lr_at, lr_factor, mark_no_decay, param_groups


def test_warmup_rises_linearly_from_the_first_step():
    o = OptimConfig(lr=1.0, warmup_steps=4, schedule="constant")
    assert [lr_factor(s, o, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_ends_at_the_minimum_on_the_last_step(schedule):
    o = OptimConfig(lr=2.0, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    lrs = [lr_at(s, o, 12) for s in range(12)]
    assert lrs[1] == 2.0 and lrs[2] == 2.0 and math.isclose(lrs[-1], 0.2)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])), lrs  # never rises after warmup
    mid = lr_factor(6, o, 11)  # halfway through the decay (steps 2..10)
    assert math.isclose(mid, 0.55 if schedule == "linear" else 0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2)


def test_wsd_holds_then_decays_over_its_last_steps():
    o = OptimConfig(lr=1.0, warmup_steps=1, schedule="wsd", decay_steps=4, min_lr_ratio=0.0)
    assert [lr_factor(s, o, 10) for s in range(10)] == [1.0] * 6 + [0.75, 0.5, 0.25, 0.0]


def test_the_schedule_is_a_pure_function_of_the_step():
    o = OptimConfig(lr=3e-3, warmup_steps=3, schedule="cosine", min_lr_ratio=0.05)
    assert [lr_at(s, o, 50) for s in range(50)] == [lr_at(s, o, 50) for s in range(50)]


def test_groups_keep_norms_biases_and_embeddings_out_of_decay():
    model = GPT(ModelConfig())
    o = OptimConfig(weight_decay=0.1)
    mark_no_decay(model, o)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, keep = param_groups(list(model.parameters()), o)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    kept = {names[id(p)] for p in keep["params"]}
    assert {"tok.weight", "pos.weight", "ln_f.weight", "ln_f.bias"} <= kept  # head.weight is tok.weight
    assert all(names[id(p)].endswith(("weight",)) and p.ndim == 2 for p in decay["params"])
    assert not {"tok.weight", "pos.weight"} & {names[id(p)] for p in decay["params"]}


def test_groups_are_configurable():
    model = GPT(ModelConfig())
    o = OptimConfig(decay_embeddings=True, decay_norms_and_biases=True)
    mark_no_decay(model, o)
    groups = param_groups(list(model.parameters()), o)
    assert len(groups) == 1 and len(groups[0]["params"]) == len(list(model.parameters()))


def test_clipping_scales_to_the_maximum_and_reports_the_norm_before():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert clip_whole([p], 1.0) == 5.0
    assert math.isclose(float(p.grad.norm()), 1.0, rel_tol=1e-5)
    assert clip_whole([p], 10.0) == pytest.approx(1.0, rel=1e-5)  # under the bound: unchanged
    assert math.isclose(float(p.grad.norm()), 1.0, rel_tol=1e-5)
