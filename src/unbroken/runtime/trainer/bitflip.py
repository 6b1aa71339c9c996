"""Silent-corruption faults inside a replica: one bit flipped in a gradient, a parameter or an optimizer state.

Owns: firing the `flip` faults of `faultspec` that target this rank (Fault.flips: once, or every K steps),
the bit arithmetic (an element's bits XORed in place through an integer view of its dtype), and the
`flip` event naming what was flipped (where, which tensor and element, which bit, the value before and
after). Does not own: catching it (trainer/agreement.py compares replicas' state; nothing here is visible
to anyone but through the values it changes), or the grammar (faultspec.py).

Where a flip lands: in=grad, inside the chosen microbatch's backward, as the gradient of parameter
`tensor` reaches it (a tensor hook: before any accumulator, bucket or overlap sees it, so it is that
microbatch's gradient and no other); in=param and in=optimizer, after the step's optimizer step and
before the step's digest (trainer/step.py's apply), so a state check of that step sees it at once.
"""
from __future__ import annotations

import torch

from unbroken.events import EventLog
from unbroken.faultspec import Fault
from unbroken.runtime.parallel.accumulator import local

# dtype -> (width in bits, integer view, top bit of its exponent, top bit of its mantissa)
_LAYOUT = {torch.float32: (32, torch.int32, 30, 22), torch.float64: (64, torch.int64, 62, 51),
           torch.bfloat16: (16, torch.int16, 14, 6), torch.float16: (16, torch.int16, 14, 9)}


def bit_index(bit: str, dtype: torch.dtype) -> int:
    """The index (0 = least significant) of `bit` ("exponent", "mantissa", "sign" or a decimal index)
    in an element of `dtype`. "exponent" is the exponent's top bit: flipped, a value under 2 in
    magnitude is multiplied by 2^128 (float32), and one in [1, 2) becomes inf (1.0) or NaN. Raises ValueError for an
    index beyond the dtype's width."""
    width, _, exponent, mantissa = _LAYOUT[dtype]
    named = {"sign": width - 1, "exponent": exponent, "mantissa": mantissa}
    index = named[bit] if bit in named else int(bit)
    if not 0 <= index < width:
        raise ValueError(f"bit {index} is beyond a {dtype} element's {width} bits")
    return index


def flip(t: torch.Tensor, element: int, bit: int) -> tuple[float, float]:
    """XOR bit `bit` of flat element `element % t.numel()` of `t` in place; returns (before, after). `t`
    must be contiguous (a parameter, its optimizer state, a gradient are)."""
    _, as_int, _, _ = _LAYOUT[t.dtype]
    flat = t.detach().view(-1)
    k = element % flat.numel()
    before = float(flat[k])
    ints = flat.view(as_int)
    mask = torch.tensor(1, dtype=as_int).bitwise_left_shift(bit)  # the sign bit's mask is the dtype's min
    ints[k] = ints[k].bitwise_xor(mask.to(ints.device))
    return before, float(flat[k])


class Flipper:
    """Build once per rank with every parsed fault; `me` its group, `rank` its rank in the group, `params`
    its parameters in unique_parameters order. Call `arm(step, i, first)` before microbatch i's
    backward and `disarm()` after it; `flip_state(step, optimizer)` after the step's optimizer step."""

    def __init__(self, faults: tuple[Fault, ...], me: int, rank: int, log: EventLog, params: list[torch.Tensor]):
        self.me, self.rank, self.log, self.params = me, rank, log, params
        self.tag = {"rank": rank} if rank else {}
        self.faults = [f for f in faults if f.kind == "flip" and f.replica == me and f.rank == rank]
        self._armed: list[tuple[Fault, int, int]] = []  # (fault, step, microbatch) whose grad flips this backward
        for tensor in sorted({f.tensor % len(params) for f in self.faults if f.target == "grad"}):
            params[tensor].register_hook(lambda g, tensor=tensor: self._grad(g, tensor))

    def arm(self, step: int, i: int, first: bool) -> None:
        """Before microbatch i's backward in `step` (`first`: the rank's first microbatch of the step)."""
        self._armed = [(f, step, i) for f in self.faults if f.target == "grad" and f.flips(self.me, step)
                       and (f.microbatch == i if f.microbatch is not None else first)]

    def disarm(self) -> None:
        self._armed = []

    def _grad(self, g: torch.Tensor, tensor: int) -> torch.Tensor | None:
        hits = [(f, step, i) for f, step, i in self._armed if f.tensor % len(self.params) == tensor]
        if not hits:
            return None  # the gradient as it is
        g = g.clone()
        for f, step, i in hits:
            self._flip(local(g), f, step, "grad", microbatch=i)
            self._armed.remove((f, step, i))  # once per backward, whatever else reaches the hook
        return g

    def flip_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """After `step`'s optimizer step, before its digest: the param and optimizer flips due now."""
        for f in self.faults:
            if f.target == "grad" or not f.flips(self.me, step):
                continue
            p = self.params[f.tensor % len(self.params)]
            if f.target == "param":
                self._flip(local(p.detach()), f, step, "param")
                continue
            state = [(k, v) for k, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v) and v.dim() > 0]
            if state:  # AdamW's exp_avg, exp_avg_sq (sorted: exp_avg first); `step` is a scalar
                name, t = state[0]
                self._flip(local(t), f, step, "optimizer", state=name)

    def _flip(self, t: torch.Tensor, f: Fault, step: int, where: str, **detail) -> None:
        bit = bit_index(f.bit, t.dtype)
        with torch.no_grad():
            before, after = flip(t, f.element, bit)
        self.log.emit("flip", replica=self.me, step=step, target=where, tensor=f.tensor,
                      element=f.element % t.numel(), bit=bit, named=f.bit, before=repr(before),
                      after=repr(after), **detail, **self.tag)
