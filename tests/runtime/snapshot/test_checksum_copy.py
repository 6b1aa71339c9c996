"""The XXH3-64 checksum definition, the 64-bit header field, memcpy copies and numpy XOR parity."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from unbroken.runtime.snapshot import checksum as ck
from unbroken.runtime.snapshot.erasure import xor_decode, xor_encode
from unbroken.runtime.snapshot.layout import BIG_COPY, copy_bytes
from unbroken.runtime.snapshot.shm import Kind, SlotFile, read_header


@pytest.mark.parametrize("n", [0, 1, ck.CHUNK - 1, ck.CHUNK, 2 * ck.CHUNK + 123])
def test_checksum_definition(n):
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    data = raw.numpy().tobytes()
    pieces = [xxhash.xxh3_64_intdigest(data[s:s + ck.CHUNK]) for s in range(0, n, ck.CHUNK)]
    want = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(pieces)}QQ", *pieces, n))
    assert ck.checksum(raw) == ck.checksum(data) == want
    if n:
        flipped = raw.clone()
        flipped[n // 2] ^= 1
        assert ck.checksum(flipped) != want


def test_header_holds_64_bit_checksum(tmp_path):
    s = SlotFile.create(tmp_path / "r0.slot0", 4096, kind=Kind.DATA, run_id="t", rank=0, world=1,
                        node=0)
    big = (1 << 64) - 3
    s.set(checksum=big, doc_len=7, rank=0, world=1)
    assert s.header().checksum == big == read_header(s.path).checksum
    assert s.get("doc_len") == 7
    s.close()


@pytest.mark.parametrize("n", [5, BIG_COPY + 3, 3 * BIG_COPY + 4097])
def test_copy_bytes(n):
    src = torch.randint(0, 256, (n + 7,), dtype=torch.uint8)
    dst = torch.zeros(n + 11, dtype=torch.uint8)
    copy_bytes(dst[5:5 + n], src[3:3 + n])
    assert torch.equal(dst[5:5 + n], src[3:3 + n]) and not dst[:5].any() and not dst[5 + n:].any()


@pytest.mark.parametrize("n,k", [(8, 2), (4096, 3), ((3 << 20) + 4096, 4), ((1 << 20) + 8, 5), (13, 3)])
def test_xor_encode_matches_bytewise_xor(n, k):
    blocks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _ in range(k)]
    want = blocks[0].clone()
    for b in blocks[1:]:
        want ^= b
    p = xor_encode(blocks)
    assert torch.equal(p, want)
    assert torch.equal(xor_decode(p, blocks[1:]), blocks[0])
