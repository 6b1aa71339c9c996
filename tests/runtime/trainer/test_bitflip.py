"""runtime/trainer/bitflip.py: which bit a name means in each dtype, the in-place XOR and its values, and a
Flipper's gradient flip landing in exactly the armed microbatch's gradient (a real backward), its event
naming what it flipped."""
from __future__ import annotations

import math

import pytest
import torch

from unbroken.events import EventLog, read_events
from unbroken.faultspec import parse
from unbroken.runtime.trainer.bitflip import Flipper, bit_index, flip

pytestmark = pytest.mark.timeout(60)


def test_named_bits_per_dtype():
    assert [bit_index(b, torch.float32) for b in ("sign", "exponent", "mantissa", "0")] == [31, 30, 22, 0]
    assert [bit_index(b, torch.float64) for b in ("sign", "exponent", "mantissa")] == [63, 62, 51]
    assert bit_index("exponent", torch.bfloat16) == 14
    with pytest.raises(ValueError, match="bit 40"):
        bit_index("40", torch.float32)


def test_flip_xors_one_bit_in_place_and_twice_restores_it():
    t = torch.tensor([1.5, -0.25, 3.0])
    assert flip(t, 1, 31) == (-0.25, 0.25)  # sign
    before, after = flip(t, 0, 30)  # [1, 2) with its exponent's top bit set: all ones, a NaN (1.0: inf)
    assert before == 1.5 and math.isnan(after)
    assert flip(t, 0, 30)[1] == 1.5  # flipped twice: the value it was
    assert flip(torch.tensor([1.0]), 0, 30) == (1.0, math.inf)
    before, after = flip(t, 5, 22)  # element 5 of 3: element 2, the mantissa's top bit
    assert (before, after) == (3.0, 2.0) and t.tolist() == [1.5, 0.25, 2.0]
    d = torch.tensor([1e-3], dtype=torch.float64)
    assert flip(d, 0, 62)[1] == pytest.approx(1e-3 * 2.0 ** 512 * 2.0 ** 512, rel=1e-12)  # finite in float64


def test_a_grad_flip_lands_in_the_armed_microbatch_only(tmp_path):
    lin = torch.nn.Linear(4, 3)
    params = [lin.weight, lin.bias]
    log = EventLog(tmp_path / "events.jsonl", who="replica0")
    flipper = Flipper(parse("flip:replica=0,step=2,in=grad,microbatch=1,tensor=1,element=2,bit=sign", 1, 5),
                      0, 0, log, params)
    x = torch.ones(2, 4)
    grads = []
    for step, i in ((1, 1), (2, 0), (2, 1)):  # a step it does not fire in, another microbatch, then its own
        lin.zero_grad()
        flipper.arm(step, i, first=i == 0)
        lin(x).sum().backward()
        flipper.disarm()
        grads.append(lin.bias.grad.clone())
    assert torch.equal(grads[0], grads[1]) and grads[0].tolist() == [2.0, 2.0, 2.0]
    assert grads[2].tolist() == [2.0, 2.0, -2.0]
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "flip"]
    assert (event["step"], event["microbatch"], event["target"], event["tensor"], event["element"], event["bit"]) == \
        (2, 1, "grad", 1, 2, 31)
    assert (event["before"], event["after"]) == ("2.0", "-2.0")
