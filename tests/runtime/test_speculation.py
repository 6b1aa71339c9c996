"""The undo of an optimizer step taken before its commit decision: exact, state and all."""
from __future__ import annotations

import pytest
import torch

from unbroken.runtime.gradients import Accumulator, unique_parameters
from unbroken.runtime.speculation import CPU_MAX_BYTES, MAX_BYTES, Rollback, limit

pytestmark = pytest.mark.timeout(60)


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = unique_parameters(model)
    return model, params, torch.optim.AdamW(params, lr=1e-2)


def step(model, opt):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot(params, opt):
    return ([p.detach().clone() for p in params],
            {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params) if p in opt.state})


def same(a, b):
    (pa, sa), (pb, sb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and sa.keys() == sb.keys()
            and all(sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa))


@pytest.mark.parametrize("steps_before", [0, 3])
def test_restore_puts_back_parameters_and_optimizer_state_bit_for_bit(steps_before):
    model, params, opt = setup()
    for _ in range(steps_before):
        step(model, opt)
    before = snapshot(params, opt)
    rb = Rollback(params, opt)
    assert rb.affordable()
    rb.save()
    step(model, opt)
    assert not same(before, snapshot(params, opt))
    rb.restore()
    assert same(before, snapshot(params, opt))
    # the optimizer goes on from the restored state exactly as if the undone step never happened
    torch.manual_seed(1)
    step(model, opt)
    after_undo = snapshot(params, opt)
    model2, params2, opt2 = setup()
    for _ in range(steps_before):
        step(model2, opt2)
    torch.manual_seed(1)
    step(model2, opt2)
    assert same(after_undo, snapshot(params2, opt2))
    with pytest.raises(RuntimeError):
        rb.restore()


def test_attach_points_grads_back_at_the_buffer_without_clearing_it():
    model, params, opt = setup()
    acc = Accumulator(params, torch.float32)
    acc.zero()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    held = acc.buffer.clone()
    for p in params:
        p.grad = None  # as zero_grad(set_to_none=True) after a speculative step
    acc.attach()
    assert torch.equal(acc.buffer, held)
    model(torch.randn(4, 8)).pow(2).mean().backward()  # adds into the buffer again
    assert not torch.equal(acc.buffer, held)


def test_step_ahead_limits_the_state_it_copies():
    assert limit("auto") == CPU_MAX_BYTES < limit("auto", "cuda") == MAX_BYTES
    assert limit("on") > 1 << 40 and limit("off") < 0
    _, params, opt = setup()
    assert Rollback(params, opt).affordable() and not Rollback(params, opt, limit("off")).affordable()
    small = sum(p.numel() * p.element_size() for p in params) - 1  # the parameters alone do not fit
    assert not Rollback(params, opt, small).affordable()


def test_saved_buffers_are_reused_and_a_restore_after_a_reuse_is_exact():
    model, params, opt = setup()
    rb = Rollback(params, opt)
    for _ in range(3):  # save, commit (drop), step: the buffers are kept and filled again
        rb.save()
        step(model, opt)
        rb.drop()
    kept = [b.data_ptr() for b in rb._buffers]
    before = snapshot(params, opt)
    rb.save()
    assert [b.data_ptr() for b in rb._buffers] == kept
    step(model, opt)
    rb.restore()
    assert same(before, snapshot(params, opt))
