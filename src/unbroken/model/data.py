"""Data: a corpus of documents, and microbatch (seed, step, i) -> tokens as a pure function.

Owns: reading the corpus (the running Python's standard library source by default, byte-level, 256
symbols; or `--data PATH`: a text file, or a uint16 token file in the nanoGPT `.bin` layout), and drawing
microbatches. Does not own: who computes a microbatch (policy) or loss weights (policy.workload).

Microbatch (s, i) depends only on (seed, s, i): which replica asks, and when, never changes it. That is
invariant 1 of DESIGN.md. Sequence lengths are fixed (`seq_len = "64"`) or, with "variable" / "MIN-MAX",
taken from the lengths of the documents they start in (capped), padded with target -1.
"""
from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from unbroken.config import DataConfig


def mix(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_microbatch(seed: int) -> None:
    """Seed the generators a microbatch's randomness (dropout) draws from: the CPU generator and, once
    CUDA is initialized, the current device's. Call before each microbatch's forward.

    The same streams as `torch.manual_seed(seed)` gives that work, at ~2 us instead of ~0.7 ms:
    torch.manual_seed also seeds every CUDA, XPU and MTIA device lazily, and each lazy call records a
    Python stack trace (traceback.format_stack) while its backend is not initialized, three a call on a
    CPU-only build; at two microbatches a step that was ~2.5% of a replica's time (py-spy)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


@dataclass(frozen=True)
class Microbatch:
    x: torch.Tensor  # (B, T) int64 inputs
    y: torch.Tensor  # (B, T) int64 targets, -1 where padded
    tokens: int  # targets that count (not padding)
    sumsq: int  # sum over sequences of length**2: the attention work, for the predictor


def part(mb: Microbatch, rank: int, parts: int) -> Microbatch:
    """Rank `rank`'s share of microbatch `mb` inside a replica group of `parts` ranks: its rows (sequences)
    rank*B/parts .. (rank+1)*B/parts - 1, with their own token count and sum of squared lengths, so that
    its loss weighted by its tokens over the step's sums, over the group's ranks, to the whole
    microbatch's. A pure function of the data API: B must be a multiple of `parts` (config checks it)."""
    if parts == 1:
        return mb
    rows = mb.x.shape[0] // parts
    x, y = mb.x[rank * rows:(rank + 1) * rows], mb.y[rank * rows:(rank + 1) * rows]
    lengths = (y != -1).sum(dim=1).tolist()  # targets that count, per sequence
    return Microbatch(x, y, sum(lengths), sum(n * n for n in lengths))


class Corpus:
    """A flat uint8/uint16 token array plus document boundaries (start offsets, ascending)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray):
        self.tokens = tokens
        self.starts = starts

    @staticmethod
    def load(cfg: DataConfig) -> "Corpus":
        if cfg.path:
            return _from_path(Path(cfg.path))
        return _stdlib(cfg.max_files)

    def doc_end(self, pos: int) -> int:
        j = int(np.searchsorted(self.starts, pos, side="right"))
        return int(self.starts[j]) if j < len(self.starts) else len(self.tokens)


def _stdlib(max_files: int) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune installed packages and tests: not the standard library's own prose and code
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    # Every machine with this Python has these files; taking every k-th keeps variety at a small size.
    stride = max(1, len(files) // max_files)
    return _from_bytes(b"\n\n".join(p.read_bytes() for p in files[::stride][:max_files]))


def _from_path(path: Path) -> Corpus:
    if path.suffix == ".bin":
        tokens = np.fromfile(path, dtype=np.uint16)
        return Corpus(tokens, np.zeros(1, dtype=np.int64))
    return _from_bytes(path.read_bytes())


def _from_bytes(raw: bytes) -> Corpus:
    """Byte tokens; a document is a block of text between blank lines (a paragraph, a function)."""
    tokens = np.frombuffer(raw, dtype=np.uint8)
    blank = np.flatnonzero((tokens[:-1] == 10) & (tokens[1:] == 10)) + 2
    starts = np.unique(np.concatenate([[0], blank[blank < len(tokens) - 1]]))
    return Corpus(tokens, starts.astype(np.int64))


class DataSource:
    """Microbatches of a run. Build one per process; `microbatch` is cheap and pure in (seed, step, i)."""

    def __init__(self, cfg: DataConfig, block_size: int, seed: int, corpus: Corpus | None = None):
        self.cfg, self.block, self.seed = cfg, block_size, seed
        self.corpus = corpus or Corpus.load(cfg)
        self.lo, self.hi = _length_range(cfg.seq_len, block_size)
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

    def microbatch(self, step: int, i: int) -> Microbatch:
        spans = self._spans(step, i)
        T = max(n for _, n in spans)
        x = torch.zeros(len(spans), T, dtype=torch.int64)
        y = torch.full((len(spans), T), -1, dtype=torch.int64)
        for row, (start, n) in enumerate(spans):
            chunk = torch.from_numpy(self.corpus.tokens[start:start + n + 1].astype(np.int64))
            x[row, :n] = chunk[:-1]
            y[row, :n] = chunk[1:]
        return Microbatch(x, y, sum(n for _, n in spans), sum(n * n for _, n in spans))

    def features(self, step: int, i: int) -> tuple[int, int]:
        """(tokens, sum of squared lengths) of microbatch (step, i), without building tensors."""
        spans = self._spans(step, i)
        return sum(n for _, n in spans), sum(n * n for _, n in spans)

    def step_tokens(self, step: int, microbatches: int) -> int:
        return sum(self.features(step, i)[0] for i in range(microbatches))


def _length_range(spec: str, block_size: int) -> tuple[int, int]:
    s = spec.strip().lower()
    try:
        if s == "variable":
            return 8, block_size
        if "-" in s:
            lo, hi = (int(v) for v in s.split("-", 1))
        else:
            lo = hi = int(s)
    except ValueError:
        raise ValueError(f"data.seq_len={spec!r}: expected a number, MIN-MAX or 'variable'") from None
    if not 1 <= lo <= hi <= block_size:
        raise ValueError(f"data.seq_len={spec!r}: lengths must lie in 1..{block_size} (model.block_size)")
    return lo, hi
