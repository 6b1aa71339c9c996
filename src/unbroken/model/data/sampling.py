"""Which tokens a sample holds, as pure functions of integers: the seed mixer, the sequence-length rule,
and the seeded permutation of fixed windows over all shards of a token-file dataset.

Owns: `mix`, `length_range`, `permute` (a keyed bijection of 0..n-1, computed per index: nothing of size
n is ever built, so a billion-window dataset costs no memory), and `Windows` (window w -> shard and
offset, its tokens and its document boundaries). Does not own: reading files (formats.py) or tensors
(source.py). Imports no torch: the launcher's checks use it too.
"""
from __future__ import annotations

import hashlib

import numpy as np

from unbroken.model.data.formats import Shard

_ROUNDS = 4


def mix(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def length_range(spec: str, block_size: int) -> tuple[int, int]:
    """(shortest, longest) sequence of `--data.seq_len` ("64", "MIN-MAX" or "variable"); ValueError
    (one line) for anything else or lengths outside 1..block_size."""
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


def permute(index: int, n: int, key: int) -> int:
    """Position `index` (0 <= index < n) of a permutation of 0..n-1 chosen by `key`: a balanced Feistel
    network over the smallest even-bit domain holding n (under 4n), walked until it lands below n
    (under 4 rounds of walking on average). A bijection for every key, so an epoch of n samples visits
    every window once."""
    if not 0 <= index < n:
        raise ValueError(f"index {index} outside 0..{n - 1}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    v = index
    while True:
        left, right = v >> half, v & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ (mix(key, r, right) & mask)
        v = (left << half) | right
        if v < n:
            return v


class Windows:
    """The windows of `length + 1` tokens (inputs and their shifted targets) that tile each shard, end to
    end (`(tokens - 1) // length` per shard; a shard's tail shorter than a window is never drawn), and
    sample n -> window: epoch n // total, position n % total of that epoch's permutation."""

    def __init__(self, shards: list[Shard], length: int, eos: int = -1, held_out: float = 0.0,
                 part: str = "train"):
        """`held_out` > 0: the last ceil(held_out x windows) windows of the tiling (in shard order) are
        evaluation's, `part` "eval" draws only them and "train" only the others: training never reads them."""
        self.shards, self.length, self.eos = shards, length, eos
        counts = [(len(s.tokens) - 1) // length for s in shards]
        self.ends = np.cumsum(counts, dtype=np.int64)
        every = int(self.ends[-1]) if len(shards) else 0
        kept = every - int(np.ceil(held_out * every)) if held_out > 0 else every
        self.first, self.total = (0, kept) if part == "train" else (kept, every - kept)
        if self.total == 0:
            raise ValueError(f"no window of {length + 1} tokens in {len(shards)} shard(s)"
                             + (f" for {part} (held out: {held_out})" if held_out > 0 else ""))

    def locate(self, seed: int, sample: int) -> tuple[int, int]:
        """(shard index, token offset) of sample `sample` (>= 0) of the run seeded `seed`."""
        epoch, r = divmod(sample, self.total)
        w = self.first + permute(r, self.total, mix(seed, epoch, self.total))
        k = int(np.searchsorted(self.ends, w, side="right"))
        return k, (w - (int(self.ends[k - 1]) if k else 0)) * self.length

    def tokens(self, shard: int, start: int) -> np.ndarray:
        """The window's length + 1 tokens as int64 (a copy: the file's pages stay the page cache's)."""
        return np.asarray(self.shards[shard].tokens[start:start + self.length + 1], dtype=np.int64)

    def boundaries(self, shard: int, start: int, window: np.ndarray) -> np.ndarray | None:
        """Offsets p in 1..length where a document starts inside the window (its input p begins a new
        document), ascending: from the shard's document index (Megatron) and after each end-of-document
        id (`eos` >= 0). None where neither marks documents."""
        found = []
        starts = self.shards[shard].doc_starts
        if starts is not None:
            lo, hi = np.searchsorted(starts, [start + 1, start + self.length + 1])
            found.append(np.asarray(starts[lo:hi], dtype=np.int64) - start)
        if self.eos >= 0:
            found.append(np.flatnonzero(window[:self.length] == self.eos) + 1)
        if not found:
            return None
        return np.unique(np.concatenate(found)) if len(found) > 1 else found[0]
