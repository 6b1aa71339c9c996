"""Hugging Face weights in and out: a `LlamaForCausalLM` directory (config.json + model.safetensors) from
a model's parameters, and a model's parameters from such a directory.

Owns: the name map between the built-in Llama (llama.py, torchtitan's names) and `LlamaForCausalLM`'s,
with the rotary layout of wq and wk (below); the map between `hf.CausalLM` (the transformers family's own
modules re-hosted without the `model.` prefix) and its Hugging Face names; the config.json of a
built-in Llama and the check that a directory's config fits `[model]`; writing and reading the directory
(the `safetensors` package; a sharded model.safetensors.index.json is read too). Does not own: where the
parameters come from (a DCP checkpoint: runtime/persist/export.py; a live model: `init_from`'s caller)
or transformers itself (never imported here: the directory is plain files).

RoPE layout. llama.py rotates each head's pairs (2i, 2i+1) as one complex number (Meta's and torchtitan's
layout); transformers' `rotate_half` pairs (i, i + head_dim/2). The same attention therefore needs each
head's rows of wq and wk reordered: row 2i+k of a head goes to row k*head_dim/2 + i (`_to_halves`), as
transformers' own convert_llama_weights_to_hf permutes Meta's checkpoints; `_to_pairs` undoes it. wv, wo
and everything else keep their rows.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
RMS_EPS = 1e-5  # llama.py's RMSNorm eps

# built-in Llama name (after "layers.N.") -> LlamaForCausalLM name (after "model.layers.N.")
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_ROOT = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads * head_dim, C) rows in pair layout -> rotate_half layout, per head."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_to_halves`."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def llama_to_hf(params: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The built-in Llama's parameters (names as `named_parameters` gives them; `cfg` its ModelConfig) under
    LlamaForCausalLM's names, wq and wk in rotate_half layout; a head tied to the embedding is left out
    (transformers ties it back from config.json's tie_word_embeddings). Raises ValueError on a name the
    map lacks."""
    from unbroken.model.llama import kv_heads

    out = {}
    for name, t in params.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        m = _LAYER.match(name)
        if m and m.group(2) in _BLOCK:
            rest = m.group(2)
            if rest == "attention.wq.weight":
                t = _to_halves(t, cfg.n_head)
            elif rest == "attention.wk.weight":
                t = _to_halves(t, kv_heads(cfg))
            out[f"model.layers.{m.group(1)}.{_BLOCK[rest]}"] = t
        elif name in _ROOT:
            out[_ROOT[name]] = t
        else:
            raise ValueError(f"parameter {name!r} is not one of the built-in Llama's")
    return out


def hf_to_llama(weights: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors under the built-in Llama's names (the inverse of `llama_to_hf`); a tied
    head becomes `output.weight` = the embedding where the model unties it. Unknown names raise ValueError."""
    from unbroken.model.llama import kv_heads

    block = {v: k for k, v in _BLOCK.items()}
    root = {v: k for k, v in _ROOT.items()}
    out = {}
    for name, t in weights.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if m and m.group(2) in block:
            rest = block[m.group(2)]
            if rest == "attention.wq.weight":
                t = _to_pairs(t, cfg.n_head)
            elif rest == "attention.wk.weight":
                t = _to_pairs(t, kv_heads(cfg))
            out[f"layers.{m.group(1)}.{rest}"] = t
        elif name in root:
            out[root[name]] = t
        elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints carry: recomputed here
            raise ValueError(f"tensor {name!r} is not one of LlamaForCausalLM's")
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def causal_to_hf(params: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """hf.CausalLM's parameters under the transformers model's names: `model.` before every name but
    lm_head's; a head tied to the embedding left out."""
    return {(n if n.startswith("lm_head.") else f"model.{n}"): t for n, t in params.items()
            if not (tied and n.startswith("lm_head."))}


def hf_to_causal(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `causal_to_hf`; a missing lm_head.weight is the embedding (tied)."""
    out = {n.removeprefix("model."): t for n, t in weights.items() if not n.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def llama_config(cfg, dtype: str = "float32") -> dict:
    """config.json of the built-in Llama of ModelConfig `cfg` as LlamaForCausalLM: what transformers needs to
    build the same network (rope_theta both as 4.x reads it and 5.x's rope_parameters)."""
    from unbroken.model.llama import ffn_width, kv_heads

    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": ffn_width(cfg), "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": kv_heads(cfg),
            "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": RMS_EPS, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "dtype": dtype}


def _theta(hf: dict) -> float:
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_problem(cfg, hf: dict) -> str | None:
    """Why a directory's config.json `hf` does not describe the built-in Llama of ModelConfig `cfg` (one line
    naming the first key that differs, as `--model.KEY`), or None where it does."""
    from unbroken.model.llama import ffn_width, kv_heads

    if hf.get("model_type") != "llama":
        return f"its model_type is {hf.get('model_type')!r}, the built-in model.arch=llama reads 'llama' only"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"its rope type {rope.get('rope_type', rope.get('type'))!r} is not llama.py's (default)"
    wanted = (("vocab_size", "vocab_size", cfg.vocab_size), ("hidden_size", "n_embd", cfg.n_embd),
              ("num_hidden_layers", "n_layer", cfg.n_layer), ("num_attention_heads", "n_head", cfg.n_head),
              ("num_key_value_heads", "n_kv_head", kv_heads(cfg)),
              ("intermediate_size", "intermediate_size", ffn_width(cfg)),
              ("tie_word_embeddings", "tie_embeddings", cfg.tie_embeddings))
    for key, ours, value in wanted:
        theirs = hf.get(key, hf.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if theirs != value:
            return f"its {key} is {theirs}, --model.{ours} gives {value}"
    if abs(_theta(hf) - cfg.rope_theta) > 1e-6 * cfg.rope_theta:
        return f"its rope_theta is {_theta(hf):g}, --model.rope_theta gives {cfg.rope_theta:g}"
    if hf.get("head_dim", cfg.n_embd // cfg.n_head) != cfg.n_embd // cfg.n_head:
        return f"its head_dim {hf['head_dim']} is not hidden_size / num_attention_heads"
    if abs(float(hf.get("rms_norm_eps", RMS_EPS)) - RMS_EPS) > 1e-12 or hf.get("hidden_act", "silu") != "silu" \
            or hf.get("attention_bias") or hf.get("mlp_bias"):
        return "its rms_norm_eps, hidden_act or biases are not llama.py's (1e-05, silu, none)"
    return None


def read_config(directory: str | Path) -> dict:
    """DIR/config.json as a dict. Raises ValueError (one line) where it is missing or not JSON."""
    path = Path(directory) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(directory)!r} has no {CONFIG}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not JSON: {e}") from None


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of DIR/model.safetensors, or of the shards DIR/model.safetensors.index.json names, on
    the CPU. Raises ValueError (one line) where neither is there."""
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / WEIGHTS).is_file():
        return load_file(str(d / WEIGHTS))
    if (d / INDEX).is_file():
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values())):
            out.update(load_file(str(d / shard)))
        return out
    raise ValueError(f"{str(directory)!r} has no {WEIGHTS} (nor {INDEX})")


def write(directory: str | Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    """Write `config` as DIR/config.json and `weights` (contiguous CPU copies) as DIR/model.safetensors."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in weights.items()}, str(d / WEIGHTS),
              metadata={"format": "pt"})
    (d / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return d


def is_builtin_llama(names) -> bool:
    """Whether parameter names are the built-in Llama's (else hf.CausalLM's: `embed_tokens`, `lm_head`)."""
    return "tok_embeddings.weight" in set(names)


def to_hf(params: dict[str, torch.Tensor], cfg, hf_config: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """(Hugging Face tensors, config.json) of a model's whole parameters `params`: the built-in Llama's
    (`cfg`, its ModelConfig) or hf.CausalLM's, whose `hf_config` (its transformers config as a dict) the
    caller supplies. Raises ValueError (one line) where neither fits."""
    if is_builtin_llama(params):
        if cfg.arch != "llama":
            raise ValueError(f"the parameters are a Llama's but the run's model.arch is {cfg.arch!r}")
        dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
        return llama_to_hf(params, cfg), llama_config(cfg, dtype)
    if "embed_tokens.weight" in params and hf_config is not None:
        return causal_to_hf(params, bool(hf_config.get("tie_word_embeddings"))), hf_config
    if "embed_tokens.weight" in params:
        raise ValueError("the parameters are a Hugging Face model's (hf.causal_lm): say its config.json "
                         "(--config DIR_OR_FILE, or train with --model.init_from=DIR)")
    raise ValueError("the parameters are neither the built-in Llama's nor a Hugging Face causal LM's "
                     "(model.arch=gpt has no Hugging Face layout here)")


def load_into(model: nn.Module, directory: str | Path, cfg) -> None:
    """Copy a Hugging Face directory's weights into `model` (the whole model a process built: the built-in
    Llama of ModelConfig `cfg`, or an hf.CausalLM) in place, before it is sharded; every parameter must be
    there with its shape. Raises ValueError (one line) on a missing, extra or misshapen tensor."""
    weights = read_weights(directory)
    names = dict(model.named_parameters(remove_duplicate=False))
    mapped = hf_to_llama(weights, cfg) if is_builtin_llama(names) else hf_to_causal(weights)
    missing = sorted(set(names) - set(mapped))
    extra = sorted(set(mapped) - set(names) - {"output.weight", "lm_head.weight"})
    if missing or extra:
        raise ValueError(f"model.init_from={str(directory)!r}: "
                         + (f"no tensor for {missing[0]!r}" if missing else f"{extra[0]!r} is not in the model"))
    with torch.no_grad():
        for name, p in names.items():
            t = mapped[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"model.init_from={str(directory)!r}: {name!r} is {tuple(t.shape)}, "
                                 f"the model's {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def check_init_from(cfg, custom_model: bool) -> None:
    """Raise ConfigError (one line) where model.init_from of Config `cfg` names no Hugging Face directory, or,
    for the built-in model (`custom_model` False), one whose config.json does not describe [model] (or
    model.arch is not llama). Call before anything starts; nothing is read where model.init_from is empty."""
    from unbroken.config import ConfigError

    where = cfg.model.init_from
    if not where:
        return
    if not Path(where).is_dir():
        raise ConfigError(f"model.init_from={where!r}: no such directory")
    try:
        hf = read_config(where)
    except ValueError as e:
        raise ConfigError(f"model.init_from={where!r}: {e}") from None
    if not (Path(where) / WEIGHTS).is_file() and not (Path(where) / INDEX).is_file():
        raise ConfigError(f"model.init_from={where!r}: no {WEIGHTS} (nor {INDEX}) there")
    if custom_model:
        return
    if cfg.model.arch != "llama":
        raise ConfigError(f"model.init_from={where!r} with model.arch={cfg.model.arch}: the built-in model that "
                          f"reads Hugging Face weights is model.arch=llama")
    problem = config_problem(cfg.model, hf)
    if problem:
        raise ConfigError(f"model.init_from={where!r}: {problem}")
