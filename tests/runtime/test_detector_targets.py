"""The excuse in tests/runtime/_detector_targets.py refuses what the device clock does not back: a Slow
verdict on a replica whose compute records read at par with its peers' is not the host's doing, one on a
replica whose records read 1.4x its peers' is. Synthetic compute records: 4 replicas, 2 microbatches a
step, variable lengths (the offline fit must explain them), one replica slowed over chosen steps."""
from __future__ import annotations

import pytest

from tests.runtime._detector_targets import BACKED, clock_ratio, failing

pytestmark = pytest.mark.timeout(30)


def records(slow_replica: int, factor: float, steps: range) -> list[dict]:
    out = []
    for step in range(12):
        for replica in range(4):
            for i, tokens in enumerate((512 + 64 * ((step + replica) % 5), 768 - 32 * (replica % 3))):
                sumsq = tokens * tokens / (1 + (step + i) % 3)
                seconds = 1e-4 * tokens + 2e-8 * sumsq + 0.002
                seconds *= 1.0 + 0.02 * (((step * 7 + replica * 3 + i) % 5) - 2)  # +-4% noise
                if replica == slow_replica and step in steps:
                    seconds *= factor
                out.append({"event": "compute", "step": step, "replica": replica, "microbatch": i,
                            "tokens": tokens, "sumsq": sumsq, "seconds": seconds})
    return out


def verdict(step: int, replica: int) -> dict:
    return {"event": "verdict", "step": step, "replica": replica, "new": "slow", "speed": 0.7}


def test_a_verdict_the_device_clock_backs_is_excused_one_it_does_not_is_not():
    events = records(2, 1.4, range(6, 10))
    assert clock_ratio(events, 8, 2) == pytest.approx(1.4, rel=0.06)
    assert clock_ratio(events, 8, 1) == pytest.approx(1.0, abs=0.06)
    backed = failing("declared slow", events, [verdict(8, 2)])
    assert backed.excused and "(8, 2) 1.4" in backed.why
    unbacked = failing("declared slow", events, [verdict(8, 1)])
    assert not unbacked.excused and clock_ratio(events, 8, 1) < BACKED
    # every flagged verdict must be backed: one unbacked among backed ones is not excused
    assert not failing("declared slow", events, [verdict(8, 2), verdict(8, 1)]).excused
    # before the slowdown's onset the clock shows nothing yet
    assert not failing("declared slow", events, [verdict(4, 2)]).excused


def test_a_fleet_wide_move_excuses_and_a_target_without_verdicts_needs_one():
    events = records(0, 1.0, range(0))
    assert not failing("never declared slow", events).excused
    moved = failing("never declared slow", events + [{"event": "regime", "factor": 0.81}])
    assert moved.excused and "0.81" in moved.why
