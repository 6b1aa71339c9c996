"""Bad snapshot input gives a typed one-line error and loads nothing: a missing directory, a
foreign run's files, a world size that differs from the snapshot's; plus the erasure codes alone."""

from __future__ import annotations

import shutil

import pytest
import torch

from snapstates import same, state
from unbroken.runtime.snapshot import errors
from unbroken.runtime.snapshot.client import SnapshotClient
from unbroken.runtime.snapshot.control import Topology
from unbroken.runtime.snapshot.erasure import RSCodec, xor_decode, xor_encode

pytestmark = pytest.mark.timeout(60)


def test_missing_foreign_and_world_mismatch(agents_factory, shm_root):
    agents = agents_factory(Topology(1, 1, "none"), run_id="run-a")
    c = SnapshotClient(agents.store, run_id="run-a", rank=0, world=1, shm_dir=agents.shm(0))
    c.save(1, state(1), {"step": 1})
    c.wait_committed(1)
    assert same(c.restore().tensors, state(1))
    # a foreign run's files under our run's name (e.g. a reused shm directory)
    shutil.copytree(shm_root / "node0" / "run-a", shm_root / "node0" / "run-b")
    cases = [
        (SnapshotClient(agents.store, run_id="run-a", rank=0, world=1, shm_dir=str(shm_root / "x")),
         errors.SnapshotNotFound),
        (SnapshotClient(agents.store, run_id="run-b", rank=0, world=1, shm_dir=agents.shm(0)),
         errors.ForeignSnapshot),
        (SnapshotClient(agents.store, run_id="run-a", rank=0, world=2, shm_dir=agents.shm(0)),
         errors.WorldSizeMismatch),
    ]
    for client, exc in cases:
        out = state(7)
        with pytest.raises(exc) as info:
            client.restore(out=out)
        assert str(info.value) and "\n" not in str(info.value)
        assert same(out, state(7))  # nothing loaded


def test_restore_into_existing_tensors(agents_factory):
    agents = agents_factory(Topology(1, 2, "none"))
    cs = [SnapshotClient(agents.store, run_id=agents.run_id, rank=r, world=2, shm_dir=agents.shm(0))
          for r in range(2)]
    for c in cs:
        c.save(5, state(5), {"step": 5, "data_pos": 1234})
        c.wait_committed(5)
    out = state(0)
    got = cs[1].restore(out=out)
    assert got.step == 5 and got.meta["data_pos"] == 1234 and same(out, state(5))


def test_xor_and_reed_solomon_recover_lost_blocks():
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (3 * 4096,), generator=g, dtype=torch.uint8) for _ in range(4)]
    p = xor_encode(data)
    assert torch.equal(xor_decode(p, [data[0], data[1], data[3]]), data[2])
    rs = RSCodec(4, 2, segment=4096)
    blocks = data + rs.encode(data)
    for lost in ([0, 1], [2, 5], [4, 5], [3]):
        have = {i: b for i, b in enumerate(blocks) if i not in lost}
        got = rs.reconstruct(have, lost)
        assert all(torch.equal(got[i], blocks[i]) for i in lost)
    with pytest.raises(ValueError):
        rs.reconstruct({i: blocks[i] for i in (0, 1, 2)}, [3, 4, 5])
