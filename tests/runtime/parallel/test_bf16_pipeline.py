"""bf16 with pipeline stages: 2 replica groups of 2 stages each in bf16 (autocast inside each stage, the hidden
states and their gradients sent between stages in bf16, float32 master weights, float64 accumulation under
--exact) are bitwise their own failure-free bf16 run through a rank killed mid-step; bf16 computes
something else than float32 (step 0's loss differs) within 2% of it."""
from __future__ import annotations

import pytest

from tests.conftest import side_by_side, unbroken
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = ["--replicas", "2", "--parallel.group_size=2", "--parallel.pp=2", "--steps", "4", "--microbatches", "4",
       "--exact", "--launch.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
       "--coord.run_timeout=240", "--data.max_files=40"]


def test_bf16_stages_through_a_rank_kill_match_their_failure_free_bf16_run(tmp_path, monkeypatch):
    # torch.distributed.pipelining checks each tensor a stage sends and receives against the stage's
    # declared metadata (dtype included) at this debug level: the bf16 activations are what travels
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    bf16 = [*RUN, "--parallel.mixed_precision=bf16"]
    clean, killed, fp32 = side_by_side(
        lambda: unbroken("train", *bf16, "--out", str(tmp_path / "clean")),
        lambda: unbroken("train", *bf16, "--faults", "kill:replica=1,rank=1,step=2,phase=compute",
                         "--out", str(tmp_path / "killed")),
        lambda: unbroken("train", *RUN, "--out", str(tmp_path / "fp32")))
    for r in (clean, killed, fp32):
        assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(tmp_path / "killed")
    kills = [(e["replica"], e.get("rank"), e["step"]) for e in events if e["event"] == "fault"]
    assert kills == [(1, 1, 2)]
    a, b = steps(read_events(tmp_path / "clean")), steps(events)
    assert b[3]["members"] == [0]  # group 1 left after its rank's death: the rest ran on group 0
    assert [a[s]["param_digest"] for s in range(4)] == [b[s]["param_digest"] for s in range(4)]
    f = steps(read_events(tmp_path / "fp32"))
    assert a[0]["loss"] != f[0]["loss"] and a[0]["loss"] == pytest.approx(f[0]["loss"], rel=0.02)
