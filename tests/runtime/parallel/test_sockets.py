"""A survivor's `shut_recorded` wakes a peer blocked in a receive from it (runtime/parallel/sockets.py): two
real gloo processes, the survivor still holding its group and a pending receive on gloo's thread."""
from __future__ import annotations

import time

import pytest

HOLD_S = 1.5  # the survivor shuts its sockets this long after the peer blocked
ALIVE_S = 6.0  # and lives on this long: the peer would wake at its exit (its sockets closed) otherwise


def _rank(rank: int, init: str, results) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.runtime.parallel.parallelize import peer_lost
    from unbroken.runtime.parallel.sockets import recorded, shut_recorded

    with recorded():
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=__import__("datetime").timedelta(seconds=60))
    dist.barrier()
    if rank == 0:  # the survivor: a receive of its own pending on gloo's thread holds the group's context
        pending = dist.irecv(torch.zeros(4), src=1)
        time.sleep(HOLD_S)
        shut = shut_recorded()
        results.put(("survivor", shut, shut_recorded()))  # the second call finds nothing recorded
        time.sleep(ALIVE_S)  # alive: only its connections were shut, not gloo's listener (that aborts)
        results.put(("survivor alive", pending is not None, 0))
        return
    began = time.monotonic()  # the blocked peer: stage 0 waiting on stage 1's survivor
    try:
        dist.recv(torch.zeros(4), src=0)
        results.put(("peer", "returned", time.monotonic() - began))
    except Exception as e:  # what the worker's group_broken path sees
        results.put(("peer", f"{peer_lost(e)}: {e}"[:200], time.monotonic() - began))


@pytest.mark.timeout(90)
def test_shutting_a_survivor_s_group_sockets_wakes_a_peer_blocked_on_it(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path}/rdzv", results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(3):
        who, a, b = results.get(timeout=60)
        got[who] = (a, b)
    for p in procs:
        p.join(timeout=30)
    shut, again = got["survivor"]
    assert shut >= 1 and again == 0, got  # its one connection to the peer (more if gloo opened several)
    woke, waited = got["peer"]
    assert woke.startswith("True: ") and "Connection closed" in woke, woke  # peer_lost: a broken group
    # blocked until the shut (the group's timeout is 60 s), and woken by it at once
    assert HOLD_S - 0.1 <= waited <= HOLD_S + 3.0 < HOLD_S + ALIVE_S, waited
    assert got["survivor alive"] == (True, 0) and procs[0].exitcode == 0, (got, procs[0].exitcode)
