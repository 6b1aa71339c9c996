"""The undo of an optimizer step taken before its commit decision: exact, state and all."""
from __future__ import annotations

import pytest
import torch

from unbroken.runtime.parallel.accumulator import Accumulator, unique_parameters
from unbroken.runtime.trainer.speculation import CPU_MAX_BYTES, MAX_BYTES, Rollback, limit

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


class Replacing(torch.optim.Optimizer):
    """Momentum SGD that puts a new momentum tensor in its state each step (torch's own update theirs
    in place) and keeps a mutable non-tensor value, changed in place: the cases a kept copy plan misses."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            s = self.state[p]
            s["momentum"] = 0.9 * s.get("momentum", torch.zeros_like(p)) + p.grad  # a new tensor
            s.setdefault("history", []).append(float(s["momentum"].sum()))  # mutated in place
            p.sub_(0.1 * s["momentum"])


def test_restore_is_exact_when_the_optimizer_replaces_or_mutates_its_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    params = unique_parameters(model)
    opt = Replacing(params)
    rb = Rollback(params, opt)
    for _ in range(3):
        rb.save()
        step(model, opt)
        rb.drop()
    before = ([p.detach().clone() for p in params],
              {i: (opt.state[p]["momentum"].clone(), list(opt.state[p]["history"])) for i, p in enumerate(params)})
    rb.save()
    step(model, opt)
    rb.restore()
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    for i, p in enumerate(params):
        assert torch.equal(opt.state[p]["momentum"], before[1][i][0]) and opt.state[p]["history"] == before[1][i][1]


def test_load_grads_points_grads_at_the_reduced_buffer_and_keeps_its_views():
    model, params, opt = setup()
    acc = Accumulator(params, torch.float32)
    acc.zero()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    reduced = acc.buffer * 2
    reduced[-1] = 3.0
    assert acc.load_grads(reduced) == 3.0
    assert all(p.grad.data_ptr() >= reduced.data_ptr() for p in params)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    assert torch.equal(flat, reduced[:-1])
    reduced.mul_(0.5)  # the same buffer, reduced again: the kept views see it
    acc.load_grads(reduced)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), acc.buffer[:-1])
    other = torch.zeros_like(reduced)  # another buffer: new views
    acc.load_grads(other)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    exact = Accumulator(params, torch.float64)  # exact mode: float32 copies of a float64 buffer
    exact.load_grads(reduced.double())
    assert all(p.grad.dtype == torch.float32 for p in params)
