"""`DataSource`: the microbatches of a run, microbatch (seed, step, i) -> tokens as a pure function.

Owns: drawing a microbatch's sequences, from a text corpus (corpus.py: the standard library's source or a
text file) or from token files (formats.py: llm.c, Megatron, raw), into tensors with their counts.
Does not own: reading files (formats.py, corpus.py), the window permutation (sampling.py), who computes a
microbatch (policy) or loss weights (policy.workload).

Sequence lengths are fixed (`seq_len = "64"`) or, with "variable" / "MIN-MAX", taken from the lengths of
the documents they start in (capped), padded with target -1. Text corpora draw random starts (at
documents for variable lengths); token files draw windows of the longest length + 1 tokens through a
seeded permutation over all shards, sample n = (step * microbatches + i) * batch_size + row, so an epoch
reads every window once; variable lengths there end a sequence at the first document boundary inside its
window (clamped to the range).
"""
from __future__ import annotations

import random

import numpy as np
import torch

from unbroken.config import DataConfig
from unbroken.model.data.batch import Microbatch
from unbroken.model.data.corpus import Corpus
from unbroken.model.data.formats import Shard, is_text, open_shards
from unbroken.model.data.sampling import Windows, length_range, mix


class DataSource:
    """Microbatches of a run. Build one per process; `microbatch` is cheap and pure in (seed, step, i).

    `held_out` > 0 (eval.split): that fraction of the data is evaluation's (the tail of a text corpus, the
    last windows of token files); `part` "train" never reads it, "eval" reads only it.

    `microbatches` is the run's microbatches per step (run.microbatches): token files number their samples
    densely with it, so call `microbatch(step, i)` with 0 <= i < microbatches. Text corpora ignore it."""

    def __init__(self, cfg: DataConfig, block_size: int, seed: int, corpus: Corpus | None = None,
                 microbatches: int = 1, held_out: float = 0.0, part: str = "train"):
        self.cfg, self.block, self.seed, self.microbatches = cfg, block_size, seed, microbatches
        self.lo, self.hi = length_range(cfg.seq_len, block_size)
        self.corpus, self.windows = corpus, None
        if corpus is None and cfg.path and not is_text(cfg.path, cfg.format):
            self.windows = Windows(_long_enough(open_shards(cfg.path, cfg.format, cfg.dtype), self.hi),
                                   self.hi, cfg.eos, held_out, part)
            return
        self.corpus = corpus or Corpus.load(cfg.path, cfg.max_files)
        if held_out > 0:  # eval.split: the corpus's tail is evaluation's, its head training's
            self.corpus = self.corpus.split(held_out, part)
        if len(self.corpus.tokens) <= self.hi + 1:
            raise ValueError(f"corpus has {len(self.corpus.tokens)} tokens, fewer than one sequence")

    def _spans(self, step: int, i: int) -> list[tuple[int, int]]:
        rng = random.Random(mix(self.seed, step, i))
        spans = []
        for _ in range(self.cfg.batch_size):
            if self.lo == self.hi:
                start, n = rng.randrange(0, len(self.corpus.tokens) - self.hi - 1), self.hi
            else:  # a whole document, its length clamped to [lo, hi]: heavy-tailed, like real text
                start = int(self.corpus.starts[rng.randrange(len(self.corpus.starts))])
                start = min(start, len(self.corpus.tokens) - self.hi - 1)
                n = min(self.hi, max(self.lo, self.corpus.doc_end(start) - start))
            spans.append((start, n))
        return spans

    def _rows(self, step: int, i: int) -> list[tuple[np.ndarray, int, np.ndarray | None]]:
        """Each row's window (hi + 1 tokens), its length and its document boundaries (token files)."""
        first = (step * self.microbatches + i) * self.cfg.batch_size
        rows = []
        for row in range(self.cfg.batch_size):
            shard, start = self.windows.locate(self.seed, first + row)
            window = self.windows.tokens(shard, start)
            bounds = self.windows.boundaries(shard, start, window)
            n = self.hi
            if self.lo < self.hi:
                end = int(bounds[0]) if bounds is not None and len(bounds) else self.hi
                n = min(self.hi, max(self.lo, end))
            rows.append((window, n, bounds))
        return rows

    def microbatch(self, step: int, i: int) -> Microbatch:
        if self.windows is not None:
            return self._from_windows(self._rows(step, i))
        spans = self._spans(step, i)
        T = max(n for _, n in spans)
        x = torch.zeros(len(spans), T, dtype=torch.int64)
        y = torch.full((len(spans), T), self.cfg.ignore_index, dtype=torch.int64)
        for row, (start, n) in enumerate(spans):
            chunk = torch.from_numpy(self.corpus.tokens[start:start + n + 1].astype(np.int64))
            x[row, :n] = chunk[:-1]
            y[row, :n] = chunk[1:]
        return Microbatch(x, y, sum(n for _, n in spans), sum(n * n for _, n in spans),
                          ignore_index=self.cfg.ignore_index)

    def _from_windows(self, rows: list[tuple[np.ndarray, int, np.ndarray | None]]) -> Microbatch:
        T = max(n for _, n, _ in rows)
        x = torch.zeros(len(rows), T, dtype=torch.int64)
        y = torch.full((len(rows), T), self.cfg.ignore_index, dtype=torch.int64)
        marked = any(b is not None for _, _, b in rows)
        positions = torch.zeros(len(rows), T, dtype=torch.int64) if marked else None
        for row, (window, n, bounds) in enumerate(rows):
            chunk = torch.from_numpy(window[:n + 1])
            x[row, :n] = chunk[:-1]
            y[row, :n] = chunk[1:]
            if positions is not None:
                positions[row, :n] = torch.from_numpy(_positions(n, bounds))
        return Microbatch(x, y, sum(n for _, n, _ in rows), sum(n * n for _, n, _ in rows), positions,
                          self.cfg.ignore_index)

    def features(self, step: int, i: int) -> tuple[int, int]:
        """(tokens, sum of squared lengths) of microbatch (step, i), without building tensors."""
        if self.windows is not None:
            if self.lo == self.hi:  # every row a whole window: nothing to read
                return self.cfg.batch_size * self.hi, self.cfg.batch_size * self.hi * self.hi
            lengths = [n for _, n, _ in self._rows(step, i)]
            return sum(lengths), sum(n * n for n in lengths)
        spans = self._spans(step, i)
        return sum(n for _, n in spans), sum(n * n for _, n in spans)

    def step_tokens(self, step: int, microbatches: int) -> int:
        return sum(self.features(step, i)[0] for i in range(microbatches))


def _positions(n: int, bounds: np.ndarray | None) -> np.ndarray:
    """Each of the first n inputs' position inside its document: 0 at the window's start and at each
    boundary (a document starting there), counting up in between."""
    pos = np.arange(n, dtype=np.int64)
    if bounds is None:
        return pos
    starts = np.concatenate([[0], bounds[bounds < n]])
    return pos - starts[np.searchsorted(starts, pos, side="right") - 1]


def _long_enough(shards: list[Shard], longest: int) -> list[Shard]:
    """`shards`, each at least one window long (config checks it first: model/data/check.py)."""
    for s in shards:
        if len(s.tokens) < longest + 1:
            raise ValueError(f"{s.path}: {len(s.tokens)} tokens, shorter than one window of {longest + 1} "
                             f"(data.seq_len + 1)")
    return shards
