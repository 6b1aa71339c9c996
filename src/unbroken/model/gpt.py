"""A small GPT in one file (after nanoGPT): token + position embeddings, pre-norm blocks, tied head.

Owns: the network and its loss. Does not own: data, parallelism, or randomness policy — dropout draws
from torch's global generator, which the trainer seeds per microbatch (seed, step, i) before forward.

Its parallel plan (`parallel_plan`, model/plan.py) is written beside it, as torchtitan writes
`parallelize_llama` beside its Llama: one FSDP2 unit per block then the root; TP splits each block's heads
(the fused qkv column-wise, its rows first reordered so each rank's run is [q | k | v] of its heads) and
MLP units (mlp.0 column-wise, mlp.2 row-wise); pipeline stages by blocks, prunable the way torchtitan's
Llama is: the blocks sit in a ModuleDict keyed by their index, so a stage that keeps some of them keeps
their names; a stage without the embeddings (`tok` None) takes hidden states (B, T, C) in; one without
the head returns them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbroken.config import ModelConfig
from unbroken.model.plan import ParallelPlan, PipelinePlan, TensorPlan


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # batch, time (tokens), channels
        # Widths are read off the tensors, not the config: under tensor parallelism `qkv` yields this
        # rank's heads only, (B, T, 3 * C / tp) laid out [q | k | v] of those heads (parallelize.py).
        qkv = self.qkv(x)
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, -1)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ignore_index: int = -1):
        super().__init__()
        self.cfg, self.ignore_index = cfg, ignore_index  # the padded targets' id (config data.ignore_index)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        # keyed "0".."n_layer-1": the same parameter names a ModuleList gives, and a pipeline stage keeps
        # its blocks' names when the others are deleted
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def no_weight_decay() -> set[str]:
        """Parameter names kept out of weight decay beside norms and biases: the embedding tables and the
        head tied to `tok` (a pipeline's last stage holds its own copy under this name)."""
        return {"tok.weight", "pos.weight", "head.weight"}

    def parallel_plan(self) -> ParallelPlan:
        """What FSDP2, TP and the pipeline act on (model/plan.py): torchtitan's plan for this GPT."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        cfg = self.cfg
        tp = TensorPlan({"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                         "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()},
                        divides=(("model.n_head", cfg.n_head),), rewrite=_heads_contiguous, slicer=_qkv_slice)
        return ParallelPlan(stack="blocks", fsdp=tuple(f"blocks.{i}" for i in range(cfg.n_layer)), tp=tp,
                            pp=PipelinePlan(first=("tok", "pos", "drop"), last=("ln_f", "head"),
                                            hidden=cfg.n_embd, vocab=cfg.vocab_size),
                            loss=self.loss)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 token ids -> (B, T, C) token + position embeddings, after dropout."""
        B, T = idx.shape
        return self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of (B, T, vocab) logits over (B, T) targets != ignore_index (padding), in
        float32 (bf16 logits are widened first: a softmax over the vocabulary in bf16 loses the loss's digits)."""
        logits = logits.float()  # a no-op on float32 logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=self.ignore_index)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) int64 (on a pipeline stage without `tok`: hidden states (B, T, C)); targets: (B, T)
        int64. Returns the mean cross-entropy over targets != ignore_index; without targets the logits
        (B, T, vocab), or on a stage without the head the hidden states (B, T, C)."""
        x = self.embed(idx) if self.tok is not None else idx
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        return logits if targets is None else self.loss(logits, targets)


def _qkv_order(rows: int, tp: int) -> torch.Tensor:
    """The fused qkv's row order in which TP rank r's contiguous run (rows / tp rows, as a column-wise
    split cuts it) is [q | k | v] of its heads: rows of q (and of k, of v) per rank are rows / 3 / tp."""
    width = rows // 3 // tp
    return torch.cat([torch.arange(r * width, (r + 1) * width) + part * (rows // 3)
                      for r in range(tp) for part in range(3)])


def _heads_contiguous(block: nn.Module, tp: int) -> None:
    """Reorder one block's qkv rows (weight and bias) before TP splits them column-wise (the forward reads
    the widths off the tensors: under TP `qkv` yields (B, T, 3 * C / tp), [q | k | v] of the rank's heads)."""
    qkv = block.attn.qkv
    order = _qkv_order(qkv.out_features, tp)
    with torch.no_grad():
        qkv.weight.copy_(qkv.weight[order])
        qkv.bias.copy_(qkv.bias[order])


def _qkv_slice(path: str, shape: tuple[int, ...], j: int, tp: int) -> tuple[int, torch.Tensor] | None:
    """TP rank j's rows of the whole model's (un-reordered) qkv: [q | k | v] of its heads."""
    if path.startswith("attn.qkv."):
        n = shape[0] // tp
        return 0, _qkv_order(shape[0], tp)[j * n:(j + 1) * n]
    return None
