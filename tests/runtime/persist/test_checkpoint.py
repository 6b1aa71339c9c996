"""DCP checkpoints on disk: async save + load roundtrip, latest discovery, typed errors that load
nothing (missing directory, foreign run, other world size)."""

from __future__ import annotations

import pytest
import torch

from unbroken.runtime.persist.checkpoint import Checkpointer, latest_checkpoint
from unbroken.runtime.snapshot.errors import (CheckpointNotFound, ForeignCheckpoint,
                                              WorldSizeMismatch)

pytestmark = pytest.mark.timeout(60)


def model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 40, generator=g), "b": torch.randn(40, generator=g),
            "step": torch.tensor([seed])}


def test_async_save_every_t_steps_and_load_roundtrip(tmp_path):
    ck = Checkpointer(tmp_path, run_id="run-a", world=1, every=2)
    saved = {}
    for step in range(1, 6):
        st = model_state(step)
        if ck.maybe_save(step, st):
            saved[step] = {k: v.clone() for k, v in st.items()}
            st["w"].add_(1.0)  # DCP staged a copy: changing the live tensors is safe
    ck.wait()
    assert sorted(saved) == [2, 4] and ck.latest() == 4
    target = model_state(99)
    assert ck.load(target) == 4
    assert all(torch.equal(target[k], saved[4][k]) for k in target)
    assert ck.load(target, step=2) == 2 and torch.equal(target["w"], saved[2]["w"])


def test_torn_checkpoint_is_not_discovered(tmp_path):
    ck = Checkpointer(tmp_path, run_id="run-a", world=1, every=1)
    ck.save_async(3, model_state(3))
    ck.wait()
    (tmp_path / "step_00000007").mkdir()  # a save that never finished: no marker
    assert latest_checkpoint(tmp_path, "run-a") == 3


@pytest.mark.parametrize("case", ["missing", "foreign", "world"])
def test_bad_directory_is_a_typed_one_line_error_and_loads_nothing(tmp_path, case):
    ck = Checkpointer(tmp_path / "ck", run_id="run-a", world=2, every=1)
    ck.save_async(1, model_state(1))
    ck.wait()
    target = model_state(42)
    before = {k: v.clone() for k, v in target.items()}
    if case == "missing":
        other, exc = Checkpointer(tmp_path / "nope", run_id="run-a", world=2, every=1), CheckpointNotFound
    elif case == "foreign":
        other, exc = Checkpointer(tmp_path / "ck", run_id="run-b", world=2, every=1), ForeignCheckpoint
    else:
        other, exc = Checkpointer(tmp_path / "ck", run_id="run-a", world=4, every=1), WorldSizeMismatch
    with pytest.raises(exc) as info:
        other.load(target)
    assert "\n" not in str(info.value) and str(info.value)
    assert all(torch.equal(target[k], before[k]) for k in target)  # nothing loaded
