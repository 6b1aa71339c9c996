"""The checks a run's token files get before anything starts (`unbroken train`, `unbroken.train`, the
demo: api.check_host), each a one-line ConfigError naming the file, so that bad data ends the command
with exit 2 instead of a worker's traceback.

Owns: opening every shard as the workers will (formats.py: a missing file or empty glob, a wrong magic,
a truncated index, a dtype that does not match the file), a shard shorter than one window, and token ids
against the model's vocabulary. Does not own: the formats themselves (formats.py) or the config's own
keys (config/tree.py). Imports no torch.
"""
from __future__ import annotations

import numpy as np

from unbroken.config import ConfigError
from unbroken.model.data.formats import Shard, is_text, open_shards
from unbroken.model.data.sampling import length_range

FULL_SCAN_BYTES = 64 << 20  # a shard up to this size is scanned whole for its largest token id
SAMPLE_CHUNKS = 64  # a larger one: this many chunks, evenly spaced, first and last included
CHUNK_BYTES = 1 << 20


def check_data(cfg) -> None:
    """Raise ConfigError (one line naming the file) where `cfg.data.path`'s token files cannot train
    `cfg.model`: unreadable or inconsistent (formats.py), shorter than one window of data.seq_len + 1
    tokens, or holding a token id outside 0..model.vocab_size - 1 (`largest_token`: a whole scan up to
    64 MiB a shard, an evenly spaced 64 MiB sample of a larger one), or an eos outside it. A text file
    and the default corpus pass: they are bytes. Reads at most ~64 MiB a shard, with plain reads: no
    page of the files stays mapped in this process."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if not d.path or is_text(d.path, d.format):
        if vocab < 256:  # corpus.py reads text as bytes
            raise ConfigError(f"model.vocab_size={vocab}: the text corpus ({d.path or 'the default'}) is "
                              f"byte-level, token ids 0..255: need model.vocab_size >= 256")
        return
    if d.eos >= vocab:
        raise ConfigError(f"data.eos={d.eos} is not a token id of model.vocab_size={vocab}")
    try:
        shards = open_shards(d.path, d.format, d.dtype)
        hi = length_range(d.seq_len, cfg.model.block_size)[1]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for s in shards:
        if len(s.tokens) < hi + 1:
            raise ConfigError(f"{s.path}: {len(s.tokens)} tokens, shorter than one window of {hi + 1} "
                              f"(data.seq_len + 1)")
        lo, top = largest_token(s)
        if top >= vocab or lo < 0:
            bad = top if top >= vocab else lo
            raise ConfigError(f"{s.path}: token id {bad} outside the model's vocabulary 0..{vocab - 1} "
                              f"(model.vocab_size={vocab})")


def largest_token(shard: Shard) -> tuple[int, int]:
    """(smallest, largest) token id of `shard`: exact for a shard up to FULL_SCAN_BYTES, else over
    SAMPLE_CHUNKS chunks of CHUNK_BYTES spread evenly from its first token to its last (a bounded read
    that a wrong dtype or vocabulary shows in at once; an id beyond the vocabulary hidden between the
    chunks of a large shard is not seen)."""
    item = shard.tokens.dtype.itemsize
    count = len(shard.tokens)
    per_chunk = max(1, CHUNK_BYTES // item)
    if count * item <= FULL_SCAN_BYTES:
        starts = range(0, count, per_chunk)
    else:
        starts = np.linspace(0, count - per_chunk, SAMPLE_CHUNKS).astype(np.int64).tolist()
    lo, hi = None, None
    with open(shard.path, "rb") as f:
        for start in starts:
            chunk = _read(f, shard, int(start), min(per_chunk, count - int(start)))
            lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
            hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
    return lo, hi


def _read(f, shard: Shard, start: int, count: int) -> np.ndarray:
    f.seek(shard.offset + start * shard.tokens.dtype.itemsize)
    return np.fromfile(f, dtype=shard.tokens.dtype, count=count)

