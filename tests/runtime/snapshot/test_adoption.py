"""A share adopted from a lost node: its first save must not wait for that node's agent.

A survivor that adopts a lost replica's share saves it into the lost node's memory (Persistence: the
share's node). Until a replacement agent serves there (seconds to start; never, on a cluster with no
spare), nothing can create that share's slots. The save skips the step instead, as it skips one a busy
agent cannot take, and the request it made is served once an agent is up."""
from __future__ import annotations

import time

import pytest

from snapstates import state
from unbroken.runtime.snapshot.client import SnapshotClient
from unbroken.runtime.snapshot.control import Topology, snapshot_keys
from unbroken.runtime.snapshot.shm import data_path

pytestmark = pytest.mark.timeout(60)


def adopter(agents, rank: int, timeout_s: float) -> SnapshotClient:
    """A client for `rank`'s share, in the memory of that rank's node, as a survivor opens one."""
    return SnapshotClient(agents.store, run_id=agents.run_id, rank=rank, world=2,
                          shm_dir=agents.shm(rank), timeout_s=timeout_s)


def test_a_share_adopted_from_a_lost_node_is_skipped_until_a_replacement_agent_serves(agents_factory):
    agents = agents_factory(Topology(2, 1, "xor", 1, 1))  # 2 nodes, one rank each, XOR parity
    own = [adopter(agents, r, 20) for r in (0, 1)]
    for c in own:
        c.save_async(1, state(1), {"step": 1})
    for c in own:
        c.wait()
        c.wait_committed(1)
    agents.kill_node(1)  # its agent and its memory are gone; rank 0 survives and adopts share 1
    keys = snapshot_keys(agents.run_id)

    # the premise: with no agent on node 1, a save that waits for its slots waits out its timeout
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not create slots"):
        adopter(agents, 1, 1.0).save_async(2, state(2), {"step": 2}, skip_if_busy=True)
    assert time.monotonic() - t0 >= 1.0

    # the survivor's save of the adopted share asks once and returns at once, the step marked skipped
    share = adopter(agents, 1, 20)
    t0 = time.monotonic()
    started = share.save_async(3, state(3), {"step": 3}, skip_if_busy=True, skip_until_allocated=True)
    assert not started and time.monotonic() - t0 < 0.5, time.monotonic() - t0
    assert agents.store.check([keys.incomplete(3)])
    assert not share.save_async(4, state(4), {"step": 4}, skip_if_busy=True, skip_until_allocated=True)

    # a replacement agent (empty memory) serves the pending request; the next save copies and commits
    agents.start(1)
    deadline, step = time.monotonic() + 10, 5
    while not share.save_async(step, state(step), {"step": step}, skip_if_busy=True, skip_until_allocated=True):
        assert time.monotonic() < deadline, "the replacement agent never created the adopted share's slots"
        time.sleep(0.05)
        step += 1
    share.wait()
    share.wait_committed(step)
    assert any(data_path(agents.shm(1), agents.run_id, 1, b).exists() for b in (0, 1))
    assert not agents.store.check([keys.incomplete(step)])
    assert agents.store.check([keys.committed(step, 1)])  # verified by the new agent's checksum
