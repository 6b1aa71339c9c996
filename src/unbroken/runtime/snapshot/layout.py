"""The flat byte stream of a named-tensor state, and its split into per-replica shards (REFT).

Owns: the layout (names, dtypes, shapes, byte offsets), the shard bounds of rank r of R, copying a
shard's byte range out of live tensors and back into tensors. Does not own where bytes live
(shm.py) or how they are protected (checksum.py, erasure.py).

The stream is the tensors' raw bytes, concatenated in the dict's insertion order, no padding.
Shard r of R is [r*S, (r+1)*S) clipped to the stream, with S rounded up to ALIGN bytes so shards
start on page boundaries; the last shards may be short or empty.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

ALIGN = 4096  # bytes; shard starts are page aligned so copies stay on page boundaries
BIG_COPY = 8 << 20  # bytes; larger CPU copies go through memcpy (see copy_bytes)
COPY_WAYS = max(1, min(2, os.cpu_count() or 1))  # threads sharing one large copy
_pool: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # e.g. "float32", as in str(torch.float32) without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # byte offset in the flat stream
    nbytes: int


@dataclass(frozen=True)
class Layout:
    specs: tuple[TensorSpec, ...]
    total: int  # bytes in the flat stream

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> Layout:
        specs, off = [], 0
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"snapshot state {name!r} is {type(t).__name__}, expected a tensor")
            n = t.numel() * t.element_size()
            specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, n))
            off += n
        return Layout(tuple(specs), off)

    def to_json(self) -> list:
        return [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.specs]

    @staticmethod
    def from_json(rows: list) -> Layout:
        specs = tuple(TensorSpec(n, d, tuple(sh), o, b) for n, d, sh, o, b in rows)
        return Layout(specs, specs[-1].offset + specs[-1].nbytes if specs else 0)

    def key(self) -> str:
        """A compact identity used to check that two ranks snapshot the same state."""
        return json.dumps(self.to_json(), separators=(",", ":"))


def shard_bounds(total: int, world: int, rank: int) -> tuple[int, int]:
    """Byte range [lo, hi) of the flat stream that `rank` of `world` replicas snapshots."""
    per = -(-total // world)
    per = -(-per // ALIGN) * ALIGN
    return min(rank * per, total), min((rank + 1) * per, total)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    # A 1-D uint8 view of a tensor's storage; non-contiguous tensors are copied once (documented).
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def pieces(layout: Layout, lo: int, hi: int) -> Iterator[tuple[TensorSpec, int, int]]:
    """(spec, start, end) byte ranges, relative to each tensor, that cover stream bytes [lo, hi)."""
    for s in layout.specs:
        a, b = max(lo, s.offset), min(hi, s.offset + s.nbytes)
        if a < b:
            yield s, a - s.offset, b - s.offset


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=COPY_WAYS, thread_name_prefix="unbroken-copy")
    return _pool


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous 1-D uint8 tensors of one length.

    Large CPU copies call glibc memcpy through ctypes (which releases the GIL), split in two halves
    on two threads: glibc streams large copies with non-temporal stores and ran 1.3-1.5x faster
    than torch's copy_ here. Other devices and small copies use copy_.
    """
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"copy of {n} bytes into {dst.numel()}")
    if n < BIG_COPY or any(t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous()
                           for t in (dst, src)):
        dst.copy_(src)
        return
    d, s = dst.data_ptr(), src.data_ptr()
    step = -(-n // COPY_WAYS // ALIGN) * ALIGN
    jobs = [_executor().submit(ctypes.memmove, d + lo, s + lo, min(step, n - lo))
            for lo in range(step, n, step)]
    ctypes.memmove(d, s, min(step, n))  # the first part on the calling thread
    for j in jobs:
        j.result()


def copy_range_out(tensors: Mapping[str, torch.Tensor], layout: Layout, lo: int, hi: int,
                   dst: torch.Tensor) -> None:
    """Copy stream bytes [lo, hi) of `tensors` into dst[0 : hi-lo] (dst: 1-D uint8)."""
    pos = 0
    for spec, a, b in pieces(layout, lo, hi):
        copy_bytes(dst[pos:pos + b - a], _bytes_of(tensors[spec.name])[a:b])
        pos += b - a


def copy_range_in(src: torch.Tensor, layout: Layout, lo: int, hi: int,
                  out: Mapping[str, torch.Tensor]) -> None:
    """Copy src[0 : hi-lo] (stream bytes [lo, hi)) into the matching bytes of `out`'s tensors.

    `out` tensors must be contiguous with the layout's dtypes and shapes (checked by the caller).
    """
    pos = 0
    for spec, a, b in pieces(layout, lo, hi):
        copy_bytes(out[spec.name].detach().reshape(-1).view(torch.uint8)[a:b], src[pos:pos + b - a])
        pos += b - a


def unflatten(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Tensors that view `flat` (1-D uint8 holding the whole stream); no copy."""
    out = {}
    for s in layout.specs:
        dt = getattr(torch, s.dtype)
        raw = flat[s.offset:s.offset + s.nbytes]
        if s.offset % dt.itemsize:  # a view must start on an element boundary: copy instead
            raw = raw.clone()
        out[s.name] = raw.view(dt).view(s.shape)
    return out


def check_out(out: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Raise ValueError unless `out` can receive `layout` in place."""
    for s in layout.specs:
        t = out.get(s.name)
        if t is None or str(t.dtype).removeprefix("torch.") != s.dtype or tuple(t.shape) != s.shape \
                or not t.is_contiguous():
            raise ValueError(f"restore target {s.name!r} does not match the snapshot "
                             f"({s.dtype}{list(s.shape)}, contiguous)")
