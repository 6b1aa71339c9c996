"""Erasure codes for snapshot shards: XOR parity (k+1) in torch and over gloo, Reed-Solomon k+m
through pyeclib.

Owns the coding arithmetic and the cross-process XOR primitive. Does not own which blocks form a
stripe or who holds them (parity.py), nor any Galois-field code: Reed-Solomon is pyeclib's
(ISA-L `isa_l_rs_vand` when the wheel bundles it, else `liberasurecode_rs_vand`).

All blocks are 1-D uint8 tensors of one length, a multiple of BLOCK_ALIGN bytes.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

BLOCK_ALIGN = 4096  # bytes; lets XOR run on int64 words and keeps pyeclib fragments unpadded
XOR_PIECE = 1 << 20  # bytes of the accumulator XORed with every block while it sits in cache
XOR_WAYS = max(1, min(2, os.cpu_count() or 1))  # threads sharing one encode
_pool: ThreadPoolExecutor | None = None


def _words(t: torch.Tensor) -> torch.Tensor:
    # XOR on int64 words is ~8x fewer element ops than on bytes.
    return t.view(torch.int64) if t.numel() % 8 == 0 else t


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=XOR_WAYS, thread_name_prefix="unbroken-xor")
    return _pool


def xor_encode(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Parity of k equal-length uint8 blocks: their bytewise XOR (a new tensor).

    CPU blocks of whole int64 words: numpy `bitwise_xor(out=)` (releases the GIL) on XOR_WAYS
    threads, one XOR_PIECE-byte piece of the result at a time, so the accumulator stays in cache
    while every block streams past it (memory traffic: read k blocks, write one). Else torch.
    """
    if not blocks:
        raise ValueError("xor_encode needs at least one block")
    n = blocks[0].numel()
    if any(b.numel() != n for b in blocks):
        raise ValueError("xor blocks must have equal length")
    if len(blocks) == 1 or n % 8 or any(b.device.type != "cpu" or b.dtype != torch.uint8
                                        or not b.is_contiguous() for b in blocks):
        acc = blocks[0].clone()
        w = _words(acc)
        for b in blocks[1:]:
            w.bitwise_xor_(_words(b))
        return acc
    acc = torch.empty(n, dtype=torch.uint8)
    a = acc.numpy().view(np.int64)
    src = [b.numpy().view(np.int64) for b in blocks]
    words, piece = n // 8, XOR_PIECE // 8

    def run(lo: int, hi: int) -> None:
        for p in range(lo, hi, piece):
            q = min(p + piece, hi)
            np.bitwise_xor(src[0][p:q], src[1][p:q], out=a[p:q])
            for b in src[2:]:
                np.bitwise_xor(a[p:q], b[p:q], out=a[p:q])

    share = -(-words // XOR_WAYS // piece) * piece  # whole pieces per thread
    jobs = [_executor().submit(run, lo, min(lo + share, words)) for lo in range(share, words, share)]
    run(0, min(share, words))
    for j in jobs:
        j.result()
    return acc


def xor_decode(parity: torch.Tensor, survivors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one missing block of a k+1 stripe: parity XOR all k-1 surviving data blocks."""
    return xor_encode([parity, *survivors])


def gloo_group(store: dist.Store, prefix: str, rank: int, size: int,
               timeout_s: float) -> dist.ProcessGroupGloo:
    """A fresh gloo group on its own store prefix (forms in ~10 ms; fails after timeout_s if a
    member never arrives)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                 datetime.timedelta(seconds=timeout_s))


def xor_reduce(pg: dist.ProcessGroup, block: torch.Tensor, root: int) -> None:
    """Cross-process XOR: after the call, `block` on `root` holds the XOR of every member's block.

    gloo uses non-root buffers as scratch (their contents are clobbered): pass a copy there.
    """
    opts = dist.ReduceOptions()
    opts.reduceOp = dist.ReduceOp.BXOR  # gloo: integer dtypes only, hence the int64 view
    opts.rootRank = root
    pg.reduce([_words(block)], opts).wait()


def _default_backend() -> str:
    from pyeclib.ec_iface import ECDriver
    try:
        ECDriver(k=2, m=1, ec_type="isa_l_rs_vand")
        return "isa_l_rs_vand"
    except Exception:  # noqa: BLE001 - pyeclib raises several types for a missing backend
        return "liberasurecode_rs_vand"


class RSCodec:
    """Systematic Reed-Solomon k+m over equal-length blocks, by pyeclib, in `segment`-byte pieces.

    Fragment indices: 0..k-1 data, k..k+m-1 parity. pyeclib prefixes each fragment with a small
    header that, without its optional checksum, depends only on (index, sizes, backend); we keep
    one per segment size and index, so blocks are stored bare and any k of them rebuild the rest.
    """

    def __init__(self, k: int, m: int, backend: str | None = None, segment: int = 512 << 10):
        from pyeclib.ec_iface import ECDriver
        if k < 1 or m < 1 or segment % BLOCK_ALIGN:
            raise ValueError(f"RSCodec needs k>=1, m>=1, segment % {BLOCK_ALIGN} == 0")
        self.k, self.m, self.segment = k, m, segment
        self.backend = backend or _default_backend()
        self._drv = ECDriver(k=k, m=m, ec_type=self.backend)
        self._headers: dict[int, list[bytes]] = {}  # segment bytes -> header per fragment index

    def _hdr(self, seg: int) -> list[bytes]:
        if seg not in self._headers:
            frags = self._drv.encode(bytes(self.k * seg))
            h = len(frags[0]) - seg
            if any(len(f) != h + seg for f in frags):
                raise RuntimeError(f"pyeclib padded a {seg}-byte segment; use aligned blocks")
            self._headers[seg] = [f[:h] for f in frags]
        return self._headers[seg]

    def encode(self, data: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """m parity blocks for k data blocks (each 1-D uint8, equal length, BLOCK_ALIGN multiple)."""
        c = _check(data, self.k)
        out = [torch.empty(c, dtype=torch.uint8) for _ in range(self.m)]
        views = [memoryview(b.numpy()) for b in data]
        for off in range(0, c, self.segment):
            seg = min(self.segment, c - off)
            h = len(self._hdr(seg)[0])
            frags = self._drv.encode(b"".join(v[off:off + seg] for v in views))
            for t in range(self.m):
                _put(out[t], off, frags[self.k + t], h, seg)
        return out

    def reconstruct(self, available: Mapping[int, torch.Tensor],
                    missing: Sequence[int]) -> dict[int, torch.Tensor]:
        """Blocks at fragment indices `missing` from at least k `available` {index: block}."""
        if len(available) < self.k:
            raise ValueError(f"RS {self.k}+{self.m} needs {self.k} blocks, got {len(available)}")
        use = dict(sorted(available.items())[: self.k])
        c = _check(list(use.values()), self.k)
        missing = sorted(missing)  # pyeclib returns rebuilt fragments in ascending index order
        out = {i: torch.empty(c, dtype=torch.uint8) for i in missing}
        views = {i: memoryview(b.numpy()) for i, b in use.items()}
        for off in range(0, c, self.segment):
            seg = min(self.segment, c - off)
            hdr = self._hdr(seg)
            frags = [hdr[i] + v[off:off + seg] for i, v in views.items()]
            rebuilt = self._drv.reconstruct(frags, list(missing))
            for i, f in zip(missing, rebuilt):
                _put(out[i], off, f, len(hdr[i]), seg)
        return out


def _put(dst: torch.Tensor, off: int, frag: bytes, skip: int, n: int) -> None:
    # numpy assignment copies from the read-only bytes without torch's non-writable warning.
    dst.numpy()[off:off + n] = np.frombuffer(frag, dtype=np.uint8, count=n, offset=skip)


def _check(blocks: Sequence[torch.Tensor], k: int) -> int:
    if len(blocks) != k:
        raise ValueError(f"expected {k} blocks, got {len(blocks)}")
    c = blocks[0].numel()
    if c % BLOCK_ALIGN or any(b.numel() != c or b.dtype != torch.uint8 for b in blocks):
        raise ValueError(f"blocks must be uint8 of one length, a multiple of {BLOCK_ALIGN}")
    return c
