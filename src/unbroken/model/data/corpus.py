"""Text corpora: byte-level tokens (256 symbols) and document starts, from the running Python's standard
library source (the default data) or a text file (`--data.path=FILE` that is no token file).

Owns: reading text and splitting it into documents at blank lines. Does not own: token files
(formats.py) or drawing microbatches (source.py).
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np


class Corpus:
    """A flat uint8 token array plus document boundaries (start offsets, ascending)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray):
        self.tokens = tokens
        self.starts = starts

    @staticmethod
    def load(path: str, max_files: int) -> "Corpus":
        """The text file at `path` (read whole: text corpora are small), or the standard library's source
        (`max_files` files of it) where `path` is empty."""
        if path:
            return from_bytes(Path(path).read_bytes())
        return stdlib(max_files)

    def split(self, held_out: float, part: str) -> "Corpus":
        """The head (`part` "train") or the tail ("eval") of the tokens, the tail `held_out` of them: a span
        drawn from one never reaches into the other."""
        cut = len(self.tokens) - int(np.ceil(held_out * len(self.tokens)))
        if part == "train":
            return Corpus(self.tokens[:cut], self.starts[self.starts < cut])
        tail = self.starts[self.starts >= cut] - cut
        return Corpus(self.tokens[cut:], np.unique(np.concatenate([[0], tail])).astype(np.int64))

    def doc_end(self, pos: int) -> int:
        j = int(np.searchsorted(self.starts, pos, side="right"))
        return int(self.starts[j]) if j < len(self.starts) else len(self.tokens)


def stdlib(max_files: int) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune installed packages and tests: not the standard library's own prose and code
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    # Every machine with this Python has these files; taking every k-th keeps variety at a small size.
    stride = max(1, len(files) // max_files)
    return from_bytes(b"\n\n".join(p.read_bytes() for p in files[::stride][:max_files]))


def from_bytes(raw: bytes) -> Corpus:
    """Byte tokens; a document is a block of text between blank lines (a paragraph, a function)."""
    tokens = np.frombuffer(raw, dtype=np.uint8)
    blank = np.flatnonzero((tokens[:-1] == 10) & (tokens[1:] == 10)) + 2
    starts = np.unique(np.concatenate([[0], blank[blank < len(tokens) - 1]]))
    return Corpus(tokens, starts.astype(np.int64))
