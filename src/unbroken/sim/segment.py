"""A failure-free stretch of training in closed form: constant step time, batch and checkpoint cadence.

Owns: when the n-th step of a stretch ends and how many steps end by a time, including blocking
persistent checkpoints taken after every `ckpt_every`-th step (counted on the global step number).
Does not own: what the stretch is made of (strategies decide the members, quotas and costs) or logging.

This is what makes the simulator event-driven: between two events nothing is looped over; the number of
steps committed is one division, corrected by at most a few checkpoint boundaries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    t0: float  # virtual time the stretch's first step starts, s
    s0: int  # global number of that step (= steps committed before the stretch)
    base: float  # compute + sync of one step on this membership, s
    overhead: float  # per-step blocking cost (in-memory snapshot), s
    microbatches: int  # microbatches reduced per step
    members: tuple[int, ...]
    epoch: int
    causes: tuple[str, ...]  # why `base` is longer than the failure-free step (lost or slow replicas)
    ckpt_every: int = 0  # persistent checkpoint after global steps that are multiples of this; 0: none
    ckpt_cost: float = 0.0  # s blocked per persistent checkpoint

    @property
    def step_time(self) -> float:
        return self.base + self.overhead

    def checkpoints(self, n: int) -> int:
        """Checkpoints taken after the first n steps of the stretch."""
        if not self.ckpt_every:
            return 0
        return (self.s0 + n) // self.ckpt_every - self.s0 // self.ckpt_every

    def end_time(self, n: int) -> float:
        """Virtual time at which the n-th step of the stretch (and its checkpoint, if any) is done."""
        return self.t0 + n * self.step_time + self.ckpt_cost * self.checkpoints(n)

    def steps_by(self, t: float) -> int:
        """How many steps of the stretch are done at time t (s)."""
        if t <= self.t0:
            return 0
        per = self.step_time + (self.ckpt_cost / self.ckpt_every if self.ckpt_every else 0.0)
        n = max(0, math.floor((t - self.t0) / per))
        while self.end_time(n + 1) <= t:
            n += 1
        while n > 0 and self.end_time(n) > t:
            n -= 1
        return n
