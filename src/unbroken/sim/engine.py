"""The discrete-event loop: a heap of timed events on a virtual clock.

Owns: ordering (time, then insertion order, so ties break the same way every run), the clock, and `rng`,
the run's seeded source for what a strategy draws during the loop (timing noise fed to the detector): it
is seeded from the run's seed, so the same seed gives the same log. Does not own: what an event means (a
handler does) or the fault trace (cluster.py draws it from its own seeded source before the loop starts).
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

Handler = Callable[[float, Any], None]


class Engine:
    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0  # virtual clock, s
        self.rng = random.Random(f"engine:{seed}")  # a stream of its own, not the fault trace's
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._handlers: dict[str, Handler] = {}

    def on(self, kind: str, handler: Handler) -> None:
        """Route events of `kind` to `handler(t, payload)`. Call before `run`."""
        self._handlers[kind] = handler

    def at(self, t: float, kind: str, payload: Any = None) -> None:
        """Schedule an event; an event in the past runs at the current time."""
        heapq.heappush(self._heap, (max(t, self.now), self._seq, kind, payload))
        self._seq += 1

    def run(self, until: float) -> None:
        """Process events in order until the heap is empty or the next one is after `until` (s)."""
        while self._heap and self._heap[0][0] <= until:
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            self._handlers[kind](t, payload)
        self.now = until
