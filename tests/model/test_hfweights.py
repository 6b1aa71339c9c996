"""Hugging Face weights in and out, in one process: the built-in Llama's parameters under LlamaForCausalLM's
names (RoPE rows permuted) give transformers' model the same logits, tied or not, with grouped-query
attention; reading them back is bitwise; hf.causal_lm's parameters round-trip too; a config.json that does
not describe [model] is named in one line."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from unbroken.config import ConfigError, ModelConfig
from unbroken.model import hfweights
from unbroken.model.llama import Llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, block_size=16,
                  vocab_size=96, rope_theta=500000.0)


def _sharp(model: Llama) -> Llama:
    """Queries and keys scaled up so attention is far from uniform (at init it is nearly so, and a wrong
    rotary layout would hardly move the logits)."""
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(30)
            block.attention.wk.weight.mul_(30)
    return model


def _export(model, cfg, path):
    weights, config = hfweights.to_hf(dict(model.named_parameters()), cfg, None)
    hfweights.write(path, weights, config)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")


@pytest.mark.parametrize("tie", [False, True])
def test_builtin_llama_gives_transformers_the_same_logits_and_reads_back_bitwise(tmp_path, tie):
    cfg = replace(CFG, tie_embeddings=tie)
    torch.manual_seed(0)
    ours = _sharp(Llama(cfg))
    theirs = _export(ours, cfg, tmp_path / "hf")
    assert type(theirs).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    torch.manual_seed(1)
    again = Llama(cfg)
    hfweights.load_into(again, tmp_path / "hf", cfg)
    assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(), again.state_dict().values()))
    assert hfweights.config_problem(cfg, hfweights.read_config(tmp_path / "hf")) is None


def test_the_rope_permutation_is_what_makes_the_logits_agree(tmp_path):
    """Without the q/k row permutation transformers' model computes something else: the check above can fail."""
    torch.manual_seed(0)
    ours = _sharp(Llama(CFG))
    weights, config = hfweights.to_hf(dict(ours.named_parameters()), CFG, None)
    for n in list(weights):
        if n.endswith(("q_proj.weight", "k_proj.weight")):
            weights[n] = dict(ours.named_parameters())[n.replace("model.", "").replace("self_attn.q_proj", "attention.wq")
                                                       .replace("self_attn.k_proj", "attention.wk")]
    hfweights.write(tmp_path / "plain", weights, config)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"))
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max() > 1e-2  # 1,000 times the tolerance above


def test_a_causal_lm_round_trips_through_its_transformers_names(tmp_path):
    from transformers import LlamaConfig

    from unbroken.model.hf import causal_lm

    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    ours = causal_lm(hf_cfg)
    weights, config = hfweights.to_hf(dict(ours.named_parameters()), CFG, hf_cfg.to_dict())
    assert "model.layers.1.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights
    hfweights.write(tmp_path / "hf", weights, config)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="sdpa")
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x).logits, atol=1e-5, rtol=0)
    torch.manual_seed(1)
    again = causal_lm(hf_cfg)
    hfweights.load_into(again, tmp_path / "hf", CFG)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), again.parameters()))
    with pytest.raises(ValueError, match="config.json"):  # without its config the layout is not enough
        hfweights.to_hf(dict(ours.named_parameters()), CFG, None)


def test_a_directory_that_does_not_describe_the_model_is_named_in_one_line(tmp_path):
    torch.manual_seed(0)
    _export(Llama(CFG), CFG, tmp_path / "hf")
    from unbroken.config import Config
    cfg = Config(model=replace(CFG, n_head=8, init_from=str(tmp_path / "hf")))
    with pytest.raises(ConfigError, match=r"num_attention_heads is 4, --model.n_head gives 8"):
        hfweights.check_init_from(cfg, custom_model=False)
    with pytest.raises(ConfigError, match=r"model.arch=gpt"):
        hfweights.check_init_from(Config(model=replace(CFG, arch="gpt", init_from=str(tmp_path / "hf"))), False)
    with pytest.raises(ConfigError, match="no such directory"):
        hfweights.check_init_from(Config(model=replace(CFG, init_from=str(tmp_path / "nope"))), False)
    hfweights.check_init_from(Config(model=replace(CFG, init_from=str(tmp_path / "hf"))), False)  # fits
    small = replace(CFG, n_layer=1)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="is not in the model"):  # a second layer the model lacks
        hfweights.load_into(Llama(small), tmp_path / "hf", small)
