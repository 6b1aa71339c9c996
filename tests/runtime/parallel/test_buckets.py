"""The reduction overlapped with backward (runtime/parallel/buckets.py, runtime/trainer/reduction.py), in one
process: the bucket layout's arithmetic, and a Reducer over a real one-member gloo group folding a GPT's
last microbatch bucket by bucket from its hooks (under --exact folding every microbatch's gradients from
them). Oracle: the accumulator the plain path builds (backward, then `add`), bit for bit, in float32 and
float64; the reduction's copy equals it, the buffer untouched."""
from __future__ import annotations

import datetime
import gc
import multiprocessing
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from unbroken.config.schema import ModelConfig
from unbroken.events import EventLog
from unbroken.model.gpt import GPT
from unbroken.policy import recovery as rec
from unbroken.runtime.parallel.accumulator import Accumulator, unique_parameters
from unbroken.runtime.parallel.buckets import BucketedReduce, Layout, add_rounded
from unbroken.runtime.parallel.collectives import EpochGroup
from unbroken.runtime.trainer.reduction import Reducer
from unbroken.runtime.trainer.stepwork import StepWork

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("sizes,bucket", [([3, 5, 2], 16), ([3, 5, 2], 1000), ([7], 4), ([1] * 9, 12)])
def test_layout_covers_the_buffer_in_reverse_order(sizes, bucket):
    layout = Layout.of_sizes(sizes, 4, bucket)
    # contiguous from the end (the loss element first) to 0
    ends = [end for _, end in layout.ranges]
    assert ends[0] == sum(sizes) + 1 and layout.ranges[-1][0] == 0
    assert all(a == b for (a, _), (_, b) in zip(layout.ranges, layout.ranges[1:]))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for k, (a, b) in enumerate(layout.ranges):
        inside = [i for i in range(len(sizes)) if a <= offsets[i] < b]
        assert [layout.of[i] for i in inside] == [k] * len(inside) and layout.count[k] == len(inside) >= 1
        assert len(inside) == 1 or (b - a) * 4 <= bucket  # over the cap only as one parameter
    assert layout.of == tuple(sorted(layout.of, reverse=True))  # later parameters, earlier buckets


def microbatch(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + i)
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x, torch.roll(x, 1, dims=1)


@pytest.fixture(scope="module")
def group():
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    g = EpochGroup(store, 0, (0,), 0, 30.0)
    g.wait_formed(lambda: False)
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overlapped_last_backward_builds_the_plain_sum(group, dtype, tmp_path):
    cfg = ModelConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.0)

    def build():
        torch.manual_seed(0)
        model = GPT(cfg)
        params = unique_parameters(model)
        return model, params, Accumulator(params, dtype)

    faults = SimpleNamespace(at=lambda *a, **k: None)
    role = SimpleNamespace(ranks=1, indices=1, holds=(0,), group=0, timed=1, shard_tag=lambda _: {})
    moving = []  # non-empty: the epoch reads as moved (a member marked to overlap must then not arm)
    coord = SimpleNamespace(moved=lambda e: bool(moving), stage=lambda *a: None)
    # the oracle: the plain path without the reducer's hooks, each microbatch's backward then `add`
    model, params, acc = build()
    acc.zero()
    for i in range(3):
        x, y = microbatch(0, i)
        loss = model(x, y) * (1 / 3)
        loss.backward()
        acc.add(loss)
    oracle = acc.buffer.clone()
    runs = []
    for overlap in (False, True, "moved"):
        model, params, acc = build()
        reducer = Reducer(role, coord, EventLog(tmp_path / f"{overlap}.jsonl"), faults,
                          SimpleNamespace(at=lambda *a, **k: None), SimpleNamespace(save_early=lambda: None),
                          lambda *key: group, params, (acc, acc), gloo=True, bucket_bytes=4096)
        assert reducer.bucketed and len(reducer.layout.ranges) > 3 and reducer.folds == (dtype == torch.float64)
        folded = []  # under --exact: each gradient already folded and dropped when the next hook runs
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: folded.append(p.grad is None))
        work = StepWork(0, acc, 96, 0.0)
        acc.zero()
        state = SimpleNamespace(epoch=0, members=(0,))
        reducer.target(work, state, [rec.Compute(0, (0, 1, 2))], settled=bool(overlap))
        moving[:] = [1] if overlap == "moved" else []
        for i in range(3):
            x, y = microbatch(0, i)
            loss = model(x, y) * (1 / 3)
            reducer.backward(work, loss, loss, 0, last=i == 2)
        moving.clear()  # moved back, as a reform that kept the members would not: the plain path reduces
        early = work.overlap.reduce.early if overlap is True else 0
        kept = acc.buffer.clone()
        assert isinstance(reducer.reduce(work, 0, 0, (0,)), rec.Reduced)
        assert torch.equal(acc.buffer, kept)  # the reduction wrote its copy, never the buffer
        # one member: the sum is the buffer itself; float64 (--exact) comes back rounded to the float32
        # gradient, reduced in a ring of bucket slots, and its float64 loss apart
        assert work.reduced[0].data_ptr() != acc.buffer.data_ptr()
        assert torch.equal(work.reduced[0], kept.to(torch.float32))
        if dtype == torch.float64:
            assert len(work.reduced) == 2 and torch.equal(work.reduced[1], kept[-1:])
            assert acc.load_reduced(work.reduced) == float(kept[-1])
            assert all(p.grad.data_ptr() == work.reduced[0].data_ptr() + 4 * off
                       for p, off in zip(params, acc.offsets))  # `.grad` is the rounded result itself
        assert len(folded) == 3 * len(params) and all(folded) == (dtype == torch.float64)
        runs.append((kept, early, len(reducer.layout.ranges)))
    (plain, none, _), (overlapped, early, buckets), (unarmed, _, _) = runs
    assert torch.equal(plain, oracle)
    # inside the last backward: every bucket (float32); under --exact at least the ring's first two, the
    # rest as soon as a slot's bucket has come back (a loaded host may not have returned one yet)
    assert none == 0 and (early == buckets if dtype == torch.float32 else 2 <= early <= buckets)
    assert torch.equal(plain, overlapped) and torch.equal(plain, unarmed)  # bit for bit, the loss included


SIZES = [5, 1, 40, 2, 30, 64, 1]
SMALL = Layout.of_sizes(SIZES, 8, bucket_bytes=8 * 24)  # 6 buckets: one of 1 gradient element, one of 2


def member_buffer(members: int, rnd: int, m: int) -> torch.Tensor:
    """Member m's float64 buffer in round `rnd`: sums of float32 values at scales 1e-6..1e5, where a
    float64 sum of a few is exact in any order (as a float64 accumulator of float32 gradients)."""
    g = torch.Generator().manual_seed(100 * members + 10 * rnd + m)
    n = sum(SIZES) + 1
    return (torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,), generator=g)).double() \
        + torch.randn(n, generator=g).double()


def member(port: int, members: int, m: int, out) -> None:
    """One member's process: two reductions in one epoch group, results to `out`."""
    store = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
    group = EpochGroup(store, 0, tuple(range(members)), m, 30.0)
    group.wait_formed(lambda: False)
    for rnd in range(2):
        buffer = member_buffer(members, rnd, m)
        slots = BucketedReduce.slot_elements(SMALL, members)
        ring = [torch.full((slots,), float("nan"), dtype=torch.float64) for _ in range(2)]
        reduce = BucketedReduce(SMALL, group, buffer, torch.empty(len(buffer)), lambda: False, ring,
                                torch.empty(1, dtype=torch.float64))
        for i in reversed(range(len(SIZES))):
            reduce.ready(i)
        into = reduce.finish().tensor
        out.put((m, rnd, into.numpy().tobytes(), float(reduce.loss), reduce.early,
                 torch.equal(buffer, member_buffer(members, rnd, m))))


@pytest.mark.parametrize("members", [2, 3, 4])
def test_exact_buckets_reduce_scatter_and_gather_the_member_order_sum(members):
    """--exact's bucketed reduction among several members (forked processes, a gloo rank each): every
    member's float32 result is the float64 buffers' sum in member order, rounded once, and the float64
    loss their sum; no buffer is written. Buckets of 1-2 elements leave some members an empty chunk; the
    second reduction on the same group checks the exchanges' tags of two reductions do not collide."""
    assert len(SMALL.ranges) == 6 and min(b - a for a, b in SMALL.ranges) == 2
    store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=member, args=(store.port, members, m, out)) for m in range(members)]
    for p in procs:
        p.start()
    got = [out.get(timeout=40) for _ in range(2 * members)]
    for p in procs:
        p.join(10)
    for m, rnd, into, loss, early, intact in got:
        parts = [member_buffer(members, rnd, j) for j in range(members)]
        total = parts[0].clone()
        for b in parts[1:]:
            total += b
        into = torch.frombuffer(bytearray(into), dtype=torch.float32)
        assert torch.equal(into[:-1], total[:-1].float()), (m, rnd)
        assert loss == float(total[-1]) and intact, (m, rnd)
        assert 2 <= early <= len(SMALL.ranges)  # during "backward": the ring's two slots at least


def test_add_rounded_rounds_once_as_torch_does():
    """The sum and rounding `add_rounded` makes equal torch's float64 adds in member order followed by
    `.to(float32)`, bit for bit (a NaN as a NaN): ties to even, float32 denormals, overflow, -0.0; and a
    column whose float64 sum depends on the order ((2^60 + 1) - 2^60) + 1 = 1, where any other order of
    adds gives 0 or 2."""
    g = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 1 + 2.0 ** -24, 1 + 3 * 2.0 ** -24, 2.0 ** -140, -2.0 ** -149 * 0.75, 3.5e38,
               -3.5e38, float("inf"), float("-inf"), float("nan"), 1e-300]
    order = [2.0 ** 60, 1.0, -(2.0 ** 60), 1.0, 0.0]
    for members in (1, 2, 3, 4, 5):
        for own in range(members):
            parts = [torch.tensor(special[j:] + special[:j] + [order[j]], dtype=torch.float64) for j in range(members)]
            parts = [torch.cat([p, torch.randn(1000, generator=g, dtype=torch.float64)]) for p in parts]
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            kept = parts[own].clone()
            out = torch.empty(len(total))
            add_rounded([p.clone() if j != own else p for j, p in enumerate(parts)], out, own)
            nan = total.isnan()  # a NaN stays a NaN; its sign and payload are the hardware's choice
            assert torch.equal(out.isnan(), nan), (members, own)
            assert torch.equal(out[~nan].view(torch.int32), total[~nan].float().view(torch.int32)), (members, own)
            assert torch.equal(parts[own].view(torch.int64), kept.view(torch.int64))  # own part only read


def test_an_exchange_waiter_thread_ends_with_its_group():
    """A group's exchanges are waited by one thread, started at its first exchange and ended when the
    group is dropped: epochs come and go over a long run, their threads do not pile up."""
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    group = EpochGroup(store, 7, (0,), 0, 30.0)
    group.wait_formed(lambda: False)
    one = group.exchange(0, [], [])
    assert one.finished.wait(5) and one.work.wait()
    waiters = [t for t in threading.enumerate() if t.name == "exchange-epoch-7"]
    assert len(waiters) == 1 and waiters[0].is_alive()
    del group, one
    gc.collect()
    waiters[0].join(5)
    assert not waiters[0].is_alive()
