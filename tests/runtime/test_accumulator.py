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
            offset = 0
            for p, grad in zip(params, grads):
                if grad is not None:
                    oracle[offset:offset + p.numel()].add_(grad.reshape(-1))
                offset += p.numel()
            oracle[-1:].add_(loss)
            if step == 2 and mb == 0:  # a reduction read the buffer mid-step (a retry adds on after it)
                assert torch.equal(acc.buffer.view(torch.int64), oracle.view(torch.int64))
        assert torch.equal(acc.buffer.view(torch.int64), oracle.view(torch.int64)), step
