"""Normal deviates in blocks, bit for bit those of `random.Random.gauss` on the same state.

Owns: drawing many standard normal deviates at once from a `random.Random`'s state, so the simulator's
timing noise costs one array operation per block instead of one Python call per microbatch, while the
values (and so every log) stay exactly what successive `rng.gauss()` calls give. Does not own: what the
deviates mean (strategies/detect.py scales them) or the engine's other uses of randomness (none: the
stream replaces the source it was taken from, which must not be drawn from afterwards).

Why exact: CPython's `random()` and numpy's legacy `RandomState.random_sample()` are the same MT19937
generator with the same 53-bit conversion (genrand_res53), so the uniforms are identical given the same
state; `gauss` is Box-Muller on pairs of them (x = u1 * 2pi, r = sqrt(-2 log(1 - u2)), then r cos x and r
sin x, the second kept for the next call). Multiplication, subtraction and sqrt are correctly rounded in
numpy as in C; log, cos and sin are taken from `math` (the platform's libm, as `random` does), because
numpy's vectorised transcendental functions may differ from libm in the last bit.
"""
from __future__ import annotations

import math
import random

import numpy as np

TWOPI = 2.0 * math.pi  # as random.py defines it
BLOCK = 1 << 16  # deviates drawn per refill


class GaussStream:
    """Successive standard normal deviates z of `rng.gauss()` (so `rng.gauss(mu, s)` = mu + z * s).

    Calling contract: build from a `random.Random` that nothing else draws from afterwards; `take(n)`
    returns the next n deviates as a float64 array. Raises ValueError if the source has a cached second
    deviate of a pair (it never has, unless `gauss` was called on it an odd number of times)."""

    def __init__(self, rng: random.Random):
        version, state, gauss_next = rng.getstate()
        if gauss_next is not None:
            raise ValueError("the source has a cached gauss deviate; build the stream from a fresh source")
        self._mt = np.random.RandomState()
        self._mt.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
        self._buf = np.empty(0)
        self._at = 0

    def take(self, n: int) -> np.ndarray:
        if self._at + n > len(self._buf):
            rest = self._buf[self._at:]
            self._buf = np.concatenate([rest, self._draw(max(BLOCK, n))])
            self._at = 0
        out = self._buf[self._at:self._at + n]
        self._at += n
        return out

    def _draw(self, n: int) -> np.ndarray:
        pairs = (n + 1) // 2
        u = self._mt.random_sample(2 * pairs)
        x2pi = u[0::2] * TWOPI
        log = np.fromiter(map(math.log, (1.0 - u[1::2]).tolist()), dtype=np.float64, count=pairs)
        g2rad = np.sqrt(-2.0 * log)
        xs = x2pi.tolist()
        out = np.empty(2 * pairs)
        out[0::2] = np.fromiter(map(math.cos, xs), dtype=np.float64, count=pairs) * g2rad
        out[1::2] = np.fromiter(map(math.sin, xs), dtype=np.float64, count=pairs) * g2rad
        return out
