"""Clipping by the global norm where a replica group's ranks hold parts of the model: FSDP2 shards (rows of
every parameter) and pipeline stages (whole parameters, the tied embedding/head on two stages, counted
once). The norm is a float64 sum of squares over the group's ranks, so every rank scales by the same
coefficient and the run is bitwise its own failure-free run through a rank killed mid-step; against the
one-rank run's norm (torch's clip_grad_norm_, float32 per-tensor norms) it agrees within float32
tolerance, which shows each element counted once: a tied weight counted on both stages, or a shard missed,
moves the norm far more than that."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import digests
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

COMMON = ["--replicas", "2", "--steps", "4", "--microbatches", "4", "--exact", "--run.progress=false",
          "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=150",
          "--model.dropout=0", "--optim.max_grad_norm=0.05", "--optim.schedule=cosine", "--optim.warmup_steps=2"]
LAYOUTS = {"fsdp2": ["--parallel.group_size=2"], "pp": ["--parallel.group_size=2", "--parallel.pp=2"]}


def train(out: Path, *args: str) -> dict[int, dict]:
    r = unbroken("train", *COMMON, *args, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return steps(read_events(out))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[int, dict]:
    return train(tmp_path_factory.mktemp("one") / "run")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_group_clips_by_its_whole_norm_bitwise_through_a_rank_kill(tmp_path, layout, one_rank):
    ref = train(tmp_path / "ref", *LAYOUTS[layout])
    norms = [ref[s]["grad_norm"] for s in range(4)]
    assert any(n > 0.05 for n in norms), f"nothing clipped: {norms}"
    want = [one_rank[s]["grad_norm"] for s in range(4)]
    assert norms == pytest.approx(want, rel=1e-5), (norms, want)  # each element counted once
    out = tmp_path / "killed"
    got = train(out, *LAYOUTS[layout], "--faults", "kill:replica=1,rank=1,step=2,phase=compute")
    events = read_events(out)
    assert [(e["replica"], e.get("rank")) for e in events if e["event"] == "fault"] == [(1, 1)]
    assert 1 in [e["replica"] for e in events if e["event"] == "member_dead"]
    assert got[3]["members"] == [0], "the killed group was not out"
    assert [got[s]["grad_norm"] for s in range(4)] == norms
    assert [digests(out)[s] for s in range(4)] == [digests(tmp_path / "ref")[s] for s in range(4)]
