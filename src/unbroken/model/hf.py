"""A Hugging Face transformers causal LM with its parallel plan: `LlamaForCausalLM` and any model of its
family shape (`model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`: Llama,
Mistral, Qwen2 and the like), built from its config.

Owns: `CausalLM`, which re-hosts the Hugging Face model's own modules (the same parameters, their
initialisation from the config, its attention and rotary code) under the layout the parallel mechanics
prune and shard, and its plan (model/plan.py): FSDP2 one unit per decoder layer then the root; TP from
the config's `base_model_tp_plan` ("colwise" / "rowwise" per decoder layer module); pipeline stages by
decoder layers (embed_tokens on the first stage, norm and lm_head on the last). Does not own:
transformers (an optional dependency: `pip install transformers`), loading pretrained weights, or the
data (its padded targets are `ignore_index`: config data.ignore_index).

Why re-hosted: Hugging Face keeps the decoder layers in an nn.ModuleList under `model.`, and a pipeline
stage that deleted some would renumber the rest; here they sit in a ModuleDict keyed by index, so each
stage keeps its layers' names, and a stage whose embedding was pruned takes hidden states in. Parameter
names are therefore `layers.3.self_attn.q_proj.weight`, not `model.layers.3...`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbroken.model.plan import ParallelPlan, PipelinePlan, TensorPlan


class CausalLM(nn.Module):
    """`hf`'s modules (a transformers *ForCausalLM of the Llama family), in unbroken's layout."""

    def __init__(self, hf: nn.Module, ignore_index: int = -1):
        super().__init__()
        inner = hf.model
        self.config, self.ignore_index = hf.config, ignore_index  # the padded targets' id (data.ignore_index)
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf.lm_head  # its weight is embed_tokens' where the config ties them

    def parallel_plan(self) -> ParallelPlan:
        """FSDP2 per decoder layer, TP from the config's base_model_tp_plan, PP by decoder layers."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        c = self.config
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        prefix = "layers.*."
        layer = {k[len(prefix):]: styles[v]() for k, v in (c.base_model_tp_plan or {}).items()
                 if k.startswith(prefix) and v in styles}
        tp = TensorPlan(layer, divides=(("num_attention_heads", c.num_attention_heads),
                                        ("num_key_value_heads", c.num_key_value_heads),
                                        ("intermediate_size", c.intermediate_size))) if layer else None
        return ParallelPlan(stack="layers", fsdp=tuple(f"layers.{i}" for i in range(len(self.layers))), tp=tp,
                            pp=PipelinePlan(first=("embed_tokens",), last=("norm", "lm_head"),
                                            hidden=c.hidden_size, vocab=c.vocab_size),
                            loss=self.loss)

    def no_weight_decay(self) -> set[str]:
        """The embedding table, and the head where the config ties it to it."""
        return {"embed_tokens.weight", *(("lm_head.weight",) if self.config.tie_word_embeddings else ())}

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of (B, T, vocab) logits over (B, T) targets != ignore_index, in float32."""
        logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=self.ignore_index)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaModel.forward without a cache: idx (B, T) token ids (hidden states (B, T, C) on a stage
        without embed_tokens); the loss with targets, else the logits (hidden states without lm_head)."""
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(idx) if self.embed_tokens is not None else idx
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is None:
            return h
        logits = self.lm_head(self.norm(h))
        return logits if targets is None else self.loss(logits, targets)


def causal_lm(config, ignore_index: int = -1) -> CausalLM:
    """A transformers causal LM of the Llama family built from `config` (a PretrainedConfig: its
    initialisation, seeded by the caller), with SDPA attention, in unbroken's layout. Call after seeding,
    once per process (every rank builds the same). `ignore_index`: the padded targets' id, the run's
    data.ignore_index (-100 where the data is Hugging Face's)."""
    from transformers import AutoModelForCausalLM

    return CausalLM(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), ignore_index)
