"""The --exact accumulator's folds on the CPU (runtime/parallel/accumulator.py), in one process: float32
gradients widened and added into float64 slices by numpy, each slice written at its first fold of a step
instead of zeroed first. Oracle: torch's add of every gradient into a float64 buffer zeroed at the step's
start (what the accumulator did before), bit for bit, signed zeros, infinities and NaNs included."""
from __future__ import annotations

import pytest
import torch

from unbroken.runtime.parallel.accumulator import Accumulator

pytestmark = pytest.mark.timeout(30)

SPECIAL = [-0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1.0]


def gradient(shape: tuple[int, ...], g: torch.Generator, sign: float) -> torch.Tensor:
    """Float32 values over ~60 binary orders of magnitude, the special values first (negated by `sign`)."""
    t = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-30, 30, shape, generator=g).float()
    flat = t.view(-1)
    n = min(len(SPECIAL), flat.numel())
    flat[:n] = sign * torch.tensor(SPECIAL[:n])
    return t


def add_to_oracle(oracle: torch.Tensor, params, grads, loss: torch.Tensor) -> None:
    """The oracle's fold of one microbatch: each gradient added into its slice, the loss into the last."""
    offset = 0
    for p, grad in zip(params, grads):
        if grad is not None:
            oracle[offset:offset + p.numel()].add_(grad.reshape(-1))
        offset += p.numel()
    oracle[-1:].add_(loss)


def test_exact_folds_match_torch_adds_into_a_zeroed_buffer_bit_for_bit():
    shapes = [(5, 7), (3,), (11, 13), (4, 6)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    acc = Accumulator(params, torch.float64)
    assert acc._wide  # the numpy path is the one under test
    oracle = torch.zeros(acc.buffer.numel(), dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        acc.zero()
        oracle.zero_()
        for mb in range(4):
            grads = [gradient(s, g, -1.0 if mb % 2 else 1.0) for s in shapes]
            grads[3] = grads[3].t().contiguous().t()  # a gradient whose strides are not the parameter's
            if mb < 2:
                grads[1] = None  # no gradient in the step's first microbatches: first written at the third
            grads[2] = None if step == 1 else grads[2]  # never in step 1: its slice must read as zeros
            for p, grad in zip(params, grads):
                p.grad = grad
            loss = torch.tensor(0.25 * (mb + 1))
            if mb == 3:  # the last one folded from the hooks, one parameter at a time, as reduction.py does
                for i in range(len(params)):
                    acc.fold(i)
                acc.add(loss)
            else:
                acc.add(loss)
            assert all(p.grad is None for p in params)
            add_to_oracle(oracle, params, grads, loss)
            if step == 2 and mb == 0:  # a reduction read the buffer mid-step (a retry adds on after it)
                assert torch.equal(acc.buffer.view(torch.int64), oracle.view(torch.int64))
        assert torch.equal(acc.buffer.view(torch.int64), oracle.view(torch.int64)), step


def test_sharded_grads_are_dtensors_over_the_reduced_copy_itself():
    """FSDP2 shards (a fake two-rank group: no peers): `.grad` is a DTensor over the reduced float32 copy
    itself, no float32 copy of it beside; kept while the reduction reuses its copy, rebuilt for another."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.config.schema import ModelConfig
    from unbroken.model.gpt import GPT
    from unbroken.runtime.parallel.accumulator import local, unique_parameters
    from unbroken.runtime.parallel.parallelize import _fully_shard
    from unbroken.runtime.parallel.precision import policy

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.0))
        model = _fully_shard(model, model.parallel_plan(), init_device_mesh("cpu", (2,)), policy("off", True))
        params = unique_parameters(model)
        acc = Accumulator(params, torch.float32)
        assert acc.sharded and not acc._wide
        reduced = torch.randn(acc.buffer.numel())
        assert acc.load_grads(reduced) == float(reduced[-1])
        first = [p.grad for p in params]
        for p, off, n in zip(params, acc.offsets, acc.sizes):
            assert isinstance(p.grad, DTensor) and p.grad.shape == p.shape
            assert local(p.grad).data_ptr() == reduced.data_ptr() + 4 * off  # the copy itself
            assert torch.equal(local(p.grad).reshape(-1), reduced[off:off + n])
        torch.optim.AdamW(params, lr=1e-3).step()  # the optimizer takes them as FSDP2's own
        reduced.mul_(2.0)  # the same copy, reduced again: the same gradients see it
        acc.load_grads(reduced)
        assert all(p.grad is g for p, g in zip(params, first))
        other = torch.zeros_like(reduced)  # another copy (after a failed reduction): gradients over it
        acc.load_grads(other)
        assert all(local(p.grad).data_ptr() == other.data_ptr() + 4 * off for p, off in zip(params, acc.offsets))
    finally:
        dist.destroy_process_group()


def test_lazy_float32_views_match_adds_into_a_zeroed_buffer_bit_for_bit():
    """float32 mode with a reducer's hooks (`lazy`): `zero` leaves the views unset and `.grad` None;
    backward hands over a fresh gradient, the hook writes 0.0 + g into the view and points `.grad` at
    it, and later microbatches add into the view in place (as AccumulateGrad does into a defined grad).
    Oracle: every gradient added into a float32 buffer zeroed at the step's start, bit for bit."""
    shapes = [(5, 7), (3,), (11, 13), (4, 6)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    acc = Accumulator(params, torch.float32)
    acc.lazy = True
    assert acc.views
    oracle = torch.zeros(acc.buffer.numel())
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        acc.zero()
        oracle.zero_()
        assert all(p.grad is None for p in params)  # nothing written: backward hands its gradients over
        for mb in range(4):
            grads = [gradient(s, g, -1.0 if mb % 2 else 1.0) for s in shapes]
            if mb < 2:
                grads[1] = None  # no gradient in the step's first microbatches: first written at the third
            grads[2] = None if step == 1 else grads[2]  # never in step 1: its slice must read as zeros
            for i, (p, grad) in enumerate(zip(params, grads)):
                if grad is None:
                    continue
                if p.grad is None:  # AccumulateGrad: a fresh gradient is handed over, else added in place
                    p.grad = grad.clone()
                else:
                    p.grad.add_(grad)
                acc.fold(i)  # the post-accumulate-grad hook
                assert p.grad.data_ptr() == acc._own[i].data_ptr()
            loss = torch.tensor(0.25 * (mb + 1))
            acc.add(loss)
            add_to_oracle(oracle, params, grads, loss)
            if step == 2 and mb == 0:  # a reduction read the buffer mid-step (a retry adds on after it)
                assert torch.equal(acc.buffer.view(torch.int32), oracle.view(torch.int32))
            if step == 3 and mb == 1:  # something set `.grad` elsewhere; the step goes on (speculation's undo)
                for p in params:
                    p.grad = torch.full_like(p, 7.0)
                acc.attach()
                assert [p.grad is None for p in params] == [False, True, False, False]
        assert torch.equal(acc.buffer.view(torch.int32), oracle.view(torch.int32)), step
