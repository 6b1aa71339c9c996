"""The two-phase seal as rules, without processes: which slot a trainer may overwrite (client), which parity
slot an encode may overwrite (agent), and the step a lost node is rebuilt at (control.rebuild_step).

The store is a dict with the three calls these rules make (set, get, check); the slots are (state, step).
"""
from __future__ import annotations

import json

import pytest

from unbroken.runtime.snapshot.client import SnapshotClient
from unbroken.runtime.snapshot.control import Topology, rebuild_step, snapshot_keys
from unbroken.runtime.snapshot.shm import State

pytestmark = pytest.mark.timeout(10)
RUN, SIB = "r", "r.s1"  # shard index 0's family and its sibling's
C, P, W, E = State.COMMITTED, State.COPIED, State.WRITING, State.EMPTY


class Store(dict):
    def set(self, key: str, value: str) -> None:
        self[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self for k in keys)


def client(store: Store) -> SnapshotClient:
    c = SnapshotClient(store, run_id=RUN, rank=0, world=2, siblings=(SIB,))
    c.topo = Topology(2, 1, "xor", 1, 1)  # as node 0's agent publishes it
    return c


def seal(store: Store, step: int, *families: str) -> None:
    for f in families:
        store.set(snapshot_keys(f).sealed(step), "parity")


def test_a_free_or_torn_slot_is_taken_first():
    c = client(Store())
    assert c._overwritable([(E, -1), (E, -1)]) == 0
    assert c._overwritable([(C, 3), (W, 4)]) == 1  # a copy that a dead writer tore holds nothing


def test_the_older_step_goes_only_once_the_newer_is_sealed_in_every_family():
    store = Store()
    c = client(store)
    seal(store, 3, RUN, SIB)
    seal(store, 4, RUN)  # its own family sealed 4; the sibling is still encoding it
    assert c._overwritable([(C, 3), (C, 4)]) is None  # keep 3, the step both families sealed
    seal(store, 4, SIB)
    assert c._overwritable([(C, 3), (C, 4)]) == 0
    seal(store, 5, RUN, SIB)
    assert c._overwritable([(C, 5), (C, 4)]) == 1  # the older, wherever it lies


def test_a_step_that_will_never_be_sealed_is_overwritten_first():
    store = Store()
    c = client(store)
    store.set(snapshot_keys(RUN).incomplete(4), "parity failed on node 1")
    assert c._overwritable([(C, 3), (C, 4)]) == 1  # 4 goes, 3 (sealed or not yet) stays
    store.set(snapshot_keys(RUN).incomplete(3), "skipped by rank 1")
    assert c._overwritable([(C, 3), (C, 4)]) == 0  # the older of two such steps


def test_a_copy_the_agent_has_not_committed_is_never_taken():
    store = Store()
    c = client(store)
    seal(store, 4, RUN, SIB)
    store.set(snapshot_keys(RUN).incomplete(5), "skipped")
    assert c._overwritable([(C, 4), (P, 5)]) is None  # the agent may be checksumming 5


def test_the_rebuild_step_is_the_newest_sealed_everywhere_and_held_with_parity_by_every_survivor():
    store = Store()
    for f in (RUN, SIB):
        for n in (0, 2):
            store.set(snapshot_keys(f).parity(n), json.dumps([1, 2] if f == SIB else [2, 3]))
    seal(store, 2, RUN, SIB)
    seal(store, 3, RUN)
    assert rebuild_step(store, [RUN, SIB], [0, 2]) == 2
    store.set(snapshot_keys(SIB).parity(2), json.dumps([1]))  # a survivor no longer holds 2's parity
    assert rebuild_step(store, [RUN, SIB], [0, 2]) is None


def test_a_step_a_rank_moved_past_without_committing_is_given_up():
    """Rank 1 died before its copy of step 4 and its share moved on (its adopter saved step 5): 4 will never
    be whole, so rank 0 overwrites it rather than skip every snapshot to the end of the run."""
    store = Store()
    c = client(store)
    store.set(snapshot_keys(RUN).held(0), json.dumps({"0": [3, 4]}))
    store.set(snapshot_keys(RUN).held(1), json.dumps({"1": [3]}))
    assert c._overwritable([(C, 3), (C, 4)]) is None  # rank 1 may still commit 4
    store.set(snapshot_keys(RUN).held(1), json.dumps({"1": [3, 5]}))
    assert c._overwritable([(C, 3), (C, 4)]) == 1
    assert store.check([snapshot_keys(SIB).incomplete(4)])  # the sibling family learns it too
