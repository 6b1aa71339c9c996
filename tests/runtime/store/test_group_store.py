"""Where a replica group's ranks meet when its torchrun agent shares no store (per-rank agents): rank 0 serves
the store at torchrun's MASTER_PORT, or at a port of its own where another process took that one since the
agent found it free (torchrun's get_free_port race), and says which in the coordinator's store."""
from __future__ import annotations

import datetime
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed import HashStore

from tests.runtime.launcher.test_cluster import free_port
from unbroken.runtime.store import keys
from unbroken.runtime.parallel.parallelize import unshared_store

pytestmark = pytest.mark.timeout(60)
TIMEOUT = datetime.timedelta(seconds=20)


def meet(port: int, relay: HashStore) -> tuple:
    """Rank 0 and rank 1 of group 3's round at `port`, side by side: (their stores, the port rank 0 said)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "2"}
    with ThreadPoolExecutor(2) as pool:
        # rank 1 first: it must wait for rank 0's word, not connect to MASTER_PORT on its own
        one = pool.submit(unshared_store, {**env, "RANK": "1"}, TIMEOUT, relay, 3)
        zero = pool.submit(unshared_store, {**env, "RANK": "0"}, TIMEOUT, relay, 3)
        stores = zero.result(), one.result()
    return stores, int(relay.get(keys.group_store_port(3, "job", f"127.0.0.1:{port}")))


def test_rank_0_serves_at_torchrun_s_port_when_it_is_free():
    port = free_port()
    (server, client), said = meet(port, HashStore())
    client.set("x", "1")
    assert said == port == server.port and server.get("x") == b"1"


def test_a_taken_port_moves_the_store_to_one_the_os_gives_and_the_ranks_still_meet():
    with socket.socket() as squatter:  # another process took the port after torchrun's agent probed it
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        (server, client), said = meet(port, HashStore())
        client.set("x", "1")
        assert said == server.port != port and server.get("x") == b"1"
