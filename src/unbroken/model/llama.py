"""A Llama-3-style model in one file (after torchtitan's llama3): RMSNorm, rotary position embeddings,
grouped-query attention, a SwiGLU feed-forward, a tied or untied head; no dropout, no biases.

Owns: the network, its loss and its parallel plan (`parallel_plan`, model/plan.py), written as torchtitan's
`parallelize_llama`: one FSDP2 unit per block then the root; TP with wq/wk/wv and w1/w3 column-wise, wo
and w2 row-wise inside each block (the embeddings, norms and head stay whole); pipeline stages by blocks.
Does not own: data, parallelism's mechanics (runtime/parallel) or randomness policy.

Module names are torchtitan's (tok_embeddings, layers.N.attention.wq, feed_forward.w1, norm, output), so
its plan reads as theirs. Prunable for pipeline stages as torchtitan prunes its Llama: the blocks sit in a
ModuleDict keyed by index; a stage without `tok_embeddings` takes hidden states (B, T, C) in, one without
`output` returns them. The rotary table is a buffer every stage holds.
Under TP the forward reads head counts off the tensors (a rank's q holds n_head / tp heads, its k and v
n_kv_head / tp), as torchtitan's does.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbroken.config import ModelConfig
from unbroken.model.plan import ParallelPlan, PipelinePlan, TensorPlan

MULTIPLE_OF = 256  # the SwiGLU width is rounded up to a multiple of this (Llama 3's multiple_of)


def kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads: model.n_kv_head, or model.n_head when 0."""
    return cfg.n_kv_head or cfg.n_head


def ffn_width(cfg: ModelConfig) -> int:
    """The SwiGLU hidden width: model.intermediate_size, else Llama 3's 2/3 x 4 x dim times
    ffn_dim_multiplier, rounded up to a multiple of 256."""
    if cfg.intermediate_size:
        return cfg.intermediate_size
    hidden = int(2 * 4 * cfg.n_embd / 3)
    if cfg.ffn_dim_multiplier:
        hidden = int(cfg.ffn_dim_multiplier * hidden)
    return MULTIPLE_OF * ((hidden + MULTIPLE_OF - 1) // MULTIPLE_OF)


def rope_table(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """(length, head_dim / 2, 2): cos and sin of position t times each pair's frequency theta^(-2i/d)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, head_dim) with each pair (2i, 2i+1) rotated by its token's angle: the complex
    product torchtitan's apply_rotary_emb takes, in real arithmetic. `table`: (T, head_dim / 2, 2) for
    positions 0..T-1, or (B, T, head_dim / 2, 2) per token (`rope_rows`)."""
    B, T, H, D = x.shape
    pairs = x.float().reshape(B, T, H, D // 2, 2)
    rows = table[:T].unsqueeze(0) if table.dim() == 3 else table
    cos, sin = (rows[..., k].view(rows.shape[0], T, 1, D // 2) for k in (0, 1))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, kv_heads(cfg) * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, kv_heads(cfg) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads, head_dim): this rank's heads under TP, read off the tensors
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, table), rotate(k, table)
        repeat = q.size(2) // k.size(2)  # query heads per key/value head (grouped-query attention)
        k, v = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_width(cfg)
        self.w1 = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, ignore_index: int = -1):
        super().__init__()
        self.cfg, self.ignore_index = cfg, ignore_index  # the padded targets' id (config data.ignore_index)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        # keyed "0".."n_layer-1": a pipeline stage keeps its blocks' names when the others are deleted
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.n_embd)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta),
                             persistent=False)
        self._init()
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _init(self) -> None:
        """torchtitan's initialisation: embeddings N(0, 1) (0.02 where the head shares them), projections
        N(0, 0.02) truncated at 2 std, the residual outputs (wo, w2) scaled down by depth, the head by
        the width."""
        cfg = self.cfg
        nn.init.normal_(self.tok_embeddings.weight, std=0.02 if cfg.tie_embeddings else 1.0)
        for i, block in enumerate(self.layers.values()):
            deep = 0.02 / math.sqrt(2 * (i + 1))
            for linear, std in ((block.attention.wq, 0.02), (block.attention.wk, 0.02), (block.attention.wv, 0.02),
                                (block.attention.wo, deep), (block.feed_forward.w1, 0.02),
                                (block.feed_forward.w2, deep), (block.feed_forward.w3, deep)):
                nn.init.trunc_normal_(linear.weight, std=std, a=-2 * std, b=2 * std)
        std = cfg.n_embd ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def parallel_plan(self) -> ParallelPlan:
        """torchtitan's parallelize_llama as a plan (model/plan.py)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        cfg = self.cfg
        col, row = ColwiseParallel(), RowwiseParallel()
        tp = TensorPlan({"attention.wq": col, "attention.wk": col, "attention.wv": col, "attention.wo": row,
                         "feed_forward.w1": col, "feed_forward.w2": row, "feed_forward.w3": col},
                        divides=(("model.n_head", cfg.n_head), ("model.n_kv_head", kv_heads(cfg)),
                                 ("model.intermediate_size", ffn_width(cfg))))
        return ParallelPlan(stack="layers", fsdp=tuple(f"layers.{i}" for i in range(cfg.n_layer)), tp=tp,
                            pp=PipelinePlan(first=("tok_embeddings",), last=("norm", "output"),
                                            hidden=cfg.n_embd, vocab=cfg.vocab_size),
                            loss=self.loss)

    def no_weight_decay(self) -> set[str]:
        """The embedding table, and the head where it is tied to it (a pipeline's last stage holds its copy
        under this name): kept out of weight decay beside norms (model/optim.py)."""
        return {"tok_embeddings.weight", *(("output.weight",) if self.cfg.tie_embeddings else ())}

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of (B, T, vocab) logits over (B, T) targets != ignore_index (padding), in
        float32."""
        logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=self.ignore_index)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) int64 (on a pipeline stage without `tok_embeddings`: hidden states (B, T, C));
        targets: (B, T) int64; positions: (B, T) int64 position of each token in its document (a
        microbatch's `positions`, where a plan with inputs=("positions",) passes them), else 0..T-1.
        Returns the mean cross-entropy over targets != ignore_index; without targets the logits
        (B, T, vocab), or on a stage without the head the hidden states (B, T, C)."""
        h = self.tok_embeddings(idx) if self.tok_embeddings is not None else idx
        table = self.rope if positions is None else self.rope[positions]  # (B, T, head_dim / 2, 2) per token
        for block in self.layers.values():
            h = block(h, table)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else self.loss(logits, targets)

