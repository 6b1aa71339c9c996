"""Chunked CRC32 checksums of byte buffers, computed on a small thread pool.

Owns the checksum definition used by every slot, shard and state digest. Does not own when
checksums are taken (the agent takes them off the trainer's critical path; restores verify them).

Definition (stable across processes and machines): split the bytes into CHUNK-byte pieces, take
zlib.crc32 of each, and fold the list with crc32 over the little-endian u32 values followed by the
length as u64. Chunking lets two cores share the work (zlib.crc32 releases the GIL for large
buffers); crc32 of 1 GiB on one core here takes 0.37-0.57 s, slower than copying it.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

try:  # Optional: ISA-L's crc32 computes the same polynomial several times faster.
    from isal.isal_zlib import crc32 as _crc32  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32

CHUNK = 16 << 20  # bytes per independently checksummed piece
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                   thread_name_prefix="unbroken-crc")
    return _pool


def _as_memoryview(buf: torch.Tensor | memoryview | bytes | bytearray) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("checksum expects a contiguous 1-D uint8 tensor")
        return memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
    return memoryview(buf).cast("B")


def chunk_crcs(buf: torch.Tensor | memoryview | bytes | bytearray) -> list[int]:
    """crc32 of each CHUNK-byte piece of `buf`, in order, computed in parallel."""
    mv = _as_memoryview(buf)
    starts = range(0, len(mv), CHUNK)
    if len(starts) <= 1:
        return [_crc32(mv)] if len(mv) else []
    return list(_executor().map(lambda s: _crc32(mv[s:s + CHUNK]), starts))


def fold(crcs: Sequence[int], length: int) -> int:
    """Fold per-piece crcs (and the total length) into one 32-bit digest."""
    return zlib.crc32(struct.pack(f"<{len(crcs)}IQ", *crcs, length))


def checksum(buf: torch.Tensor | memoryview | bytes | bytearray) -> int:
    """The digest of `buf` (1-D uint8 tensor or any bytes-like). Thread-safe; blocks until done."""
    mv = _as_memoryview(buf)
    return fold(chunk_crcs(mv), len(mv))


def state_digest(shard_checksums: Sequence[int], total: int) -> int:
    """Digest of a whole flat state from its shards' checksums, in rank order.

    Recomputing every shard checksum over a reassembled buffer and folding them checks every byte of
    the reassembled state against what was recorded at snapshot time.
    """
    return fold(shard_checksums, total)
