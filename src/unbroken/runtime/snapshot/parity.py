"""Parity across nodes: which blocks form each stripe, and the collective encode and rebuild.

Owns the rotated stripe plan and the gloo traffic of one parity group of G = k + m agents (one per
node, so every stripe spans G failure domains). Does not own slot files or when to run (agent.py).

Plan, per layer (layer i = the i-th trainer rank of each node): member j's data shard, zero padded
to k*c bytes, is cut into k chunks of c bytes. There are G stripes; stripe s keeps its m parity
blocks on members s, s+1, ..., s+m-1 (mod G) and takes one data chunk from each of the other k
members. Each member thus holds k data chunks and m parity blocks (parity overhead m/k) and no
stripe has two blocks on one node: losing up to m nodes loses at most m blocks of any stripe.

Block of member j in stripe s: fragment index d < k (data chunk number q of j) or k + t (parity
block t, stored at [t*c, (t+1)*c) of j's parity area).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .erasure import BLOCK_ALIGN, RSCodec, xor_reduce


@dataclass(frozen=True)
class StripePlan:
    k: int
    m: int

    @property
    def size(self) -> int:
        return self.k + self.m

    def role(self, j: int, s: int) -> int:
        """Fragment index of member j in stripe s: 0..k-1 data, k..k+m-1 parity."""
        t = (j - s) % self.size
        return self.k + t if t < self.m else t - self.m

    def member(self, s: int, role: int) -> int:
        return (s + (role - self.k if role >= self.k else role + self.m)) % self.size

    def chunk(self, j: int, s: int) -> int:
        """Which of member j's k data chunks goes into stripe s (j must be a data member of s)."""
        return self.role(j, s)

    def chunk_bytes(self, longest_shard: int) -> int:
        """c: chunk length for shards of up to `longest_shard` bytes (multiple of BLOCK_ALIGN)."""
        per = -(-max(longest_shard, 1) // self.k)
        return -(-per // BLOCK_ALIGN) * BLOCK_ALIGN


def _data_block(shard: torch.Tensor, q: int, c: int) -> torch.Tensor:
    # A private copy of chunk q (zero padded past the shard's end): gloo clobbers reduce inputs.
    out = torch.zeros(c, dtype=torch.uint8)
    part = shard[q * c:(q + 1) * c]
    out[: part.numel()] = part
    return out


class Member:
    """One agent's view of a parity group for one layer: its shard and parity area."""

    def __init__(self, plan: StripePlan, j: int, c: int, shard: torch.Tensor | None,
                 parity: torch.Tensor, codec: RSCodec | None) -> None:
        self.plan, self.j, self.c, self.shard, self.parity, self.codec = plan, j, c, shard, parity, codec

    def block(self, s: int) -> torch.Tensor:
        r = self.plan.role(self.j, s)
        if r < self.plan.k:
            return _data_block(self.shard, r, self.c)
        t = r - self.plan.k
        return self.parity[t * self.c:(t + 1) * self.c].clone()

    def target(self, s: int, data_out: torch.Tensor) -> torch.Tensor:
        """Where member j's own block of stripe s goes when rebuilt (view into data_out/parity)."""
        r, c = self.plan.role(self.j, s), self.c
        if r < self.plan.k:
            return data_out[r * c:(r + 1) * c]
        t = r - self.plan.k
        return self.parity[t * c:(t + 1) * c]


def encode(pg: dist.ProcessGroup, me: Member, tag0: int) -> None:
    """Collective over the group: fill every member's parity area from all members' shards."""
    plan, c = me.plan, me.c
    for s in range(plan.size):
        if plan.m == 1:  # XOR: reduce the k data chunks onto the one parity holder
            root = plan.member(s, plan.k)
            buf = me.parity[0:c] if me.j == root else me.block(s)
            if me.j == root:
                buf.zero_()
            xor_reduce(pg, buf, root)
            continue
        enc = plan.member(s, plan.k)  # first parity holder gathers the data and encodes
        role = plan.role(me.j, s)
        if role < plan.k:
            pg.send([me.block(s)], enc, tag0 + s).wait()
        elif me.j == enc:
            data = [torch.empty(c, dtype=torch.uint8) for _ in range(plan.k)]
            works = [pg.recv([data[d]], plan.member(s, d), tag0 + s) for d in range(plan.k)]
            for w in works:
                w.wait()
            par = me.codec.encode(data)
            me.parity[0:c] = par[0]
            for t in range(1, plan.m):
                pg.send([par[t]], plan.member(s, plan.k + t), tag0 + s).wait()
        else:
            t = role - plan.k
            pg.recv([me.parity[t * c:(t + 1) * c]], enc, tag0 + s).wait()


def rebuild(pg: dist.ProcessGroup, me: Member, lost: list[int], data_out: torch.Tensor | None,
            tag0: int, progress: Callable[[int], None] | None = None) -> None:
    """Collective over the group: lost members get back their shard (into data_out, k*c bytes)
    and parity area; survivors serve their blocks. len(lost) <= m (checked by the caller)."""
    plan = me.plan
    lost = sorted(lost)
    for s in range(plan.size):
        if plan.m == 1:
            x = lost[0]  # XOR of every other block of the stripe is x's block
            if me.j == x:
                buf = me.target(s, data_out)
                buf.zero_()
            else:
                buf = me.block(s)
            xor_reduce(pg, buf, x)
        else:
            _rs_stripe(pg, me, s, lost, data_out, tag0 + s)
        if progress:
            progress(s)


def _rs_stripe(pg, me: Member, s: int, lost: list[int], data_out, tag: int) -> None:
    plan = me.plan
    dec = lost[0]  # a lost member rebuilds: it needs the bytes anyway
    roles = {j: plan.role(j, s) for j in range(plan.size)}
    helpers = sorted((j for j in roles if j not in lost), key=roles.__getitem__)[: plan.k]
    if me.j in helpers:
        pg.send([me.block(s)], dec, tag).wait()
    elif me.j == dec:
        got = {roles[h]: torch.empty(me.c, dtype=torch.uint8) for h in helpers}
        works = [pg.recv([got[roles[h]]], h, tag) for h in helpers]
        for w in works:
            w.wait()
        out = me.codec.reconstruct(got, [roles[x] for x in lost])
        for x in lost:
            if x == dec:
                me.target(s, data_out).copy_(out[roles[x]])
            else:
                pg.send([out[roles[x]]], x, tag).wait()
    elif me.j in lost:
        pg.recv([me.target(s, data_out)], dec, tag).wait()
