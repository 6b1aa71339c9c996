"""Replica groups of 4 ranks with FSDP2 composed with another degree, as torchtitan composes them, 2 groups,
each a real `torchrun` job of the local launcher, in `--exact`, dropout 0 (masks drawn for a shard's rows
are not the whole microbatch's):
  fsdp x tp  `--parallel.group_size=4 --parallel.tp=2`: the (dp_shard, tp) mesh, TP innermost, TP applied
             first and FSDP2 over it; rank = FSDP shard x 2 + TP index;
  pp x fsdp  `--parallel.group_size=4 --parallel.pp=2`: the (pp, dp_shard) mesh, each stage's blocks
             sharded by FSDP2 over its 2 ranks; rank = stage x 2 + FSDP shard; stage s's shard k feeds
             stage s+1's shard k, and the tied embedding/head's batch sums are added over the stages.
  all three  `--parallel.group_size=8 --parallel.pp=2 --parallel.tp=2`: the (pp, dp_shard, tp) mesh.
Each way an FSDP shard's ranks take its rows of each microbatch.

The failure-free run stays within float32 tolerance of the one-rank run (TP's partial sums; the tied
weight's per-stage batch sums: other float32 sums); a rank killed mid-step takes its group out, the
survivors redo its microbatches, torchrun restarts the group, and it rejoins with each of its 4 ranks
healed from the donor's rank of the same index (its DTensor piece and optimizer state), every step's
digest that of the failure-free run of the same topology. `test_pp_tp_persist.py` restarts such groups
from disk.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import digests, run_faults
from tests.runtime.parallel.test_pp_tp import train
from unbroken.config import Config
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

N = 20  # steps: the kill at step 2, then torchrun's restart of 4 workers and the heal, with steps to spare
COMMON = ["--replicas", "2", "--steps", str(N), "--microbatches", "3", "--exact", "--run.progress=false",
          "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=170",
          "--model.dropout=0", "--run.quotas=equal"]  # equal: owners comparable across runs whatever their speed
LAYOUTS = {"fsdp x tp": [*COMMON, "--parallel.group_size=4", "--parallel.tp=2"],
           "pp x fsdp": [*COMMON, "--parallel.group_size=4", "--parallel.pp=2"]}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def reference(request, tmp_path_factory) -> tuple[str, Path]:
    """(The layout, its failure-free run)."""
    return request.param, train(tmp_path_factory, request.param.replace(" ", ""), LAYOUTS[request.param])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The same config in 2 groups of one rank: plain data parallelism."""
    return train(tmp_path_factory, "one-rank", COMMON)


def test_failure_free_run_is_within_float32_tolerance_of_the_one_rank_run(reference, one_rank):
    """Every step's loss within 1e-5 (relative; measured at most 2.1e-7 over 20 steps for fsdp x tp, and
    2.0e-6 for pp x fsdp) of the one-rank run's, with the same owners. Every rank computed each
    microbatch of its group's quota (its heads or its stage): its FSDP shard's rows, the same rows as the
    other ranks of its shard, and the two shards' rows make up the whole microbatch."""
    layout, run = reference
    grid, dp = steps(read_events(run)), steps(read_events(one_rank))
    assert sorted(grid) == sorted(dp) == list(range(N))
    drift = [abs(grid[s]["loss"] - dp[s]["loss"]) / dp[s]["loss"] for s in sorted(dp)]
    assert max(drift) <= 1e-5, (layout, drift)
    assert all(grid[s]["ranks"] == 8 and grid[s]["owners"] == dp[s]["owners"] for s in grid)
    topology = Config.from_json((run / "config.json").read_text()).topology()
    shard = {j: topology.coords(j)[1] for j in range(4)}  # rank -> its FSDP shard
    assert sorted(shard.values()) == [0, 0, 1, 1]
    tokens = {(e["replica"], e["rank"], e["microbatch"]): e["tokens"] for e in read_events(run)
              if e["event"] == "compute" and e["step"] == 0}
    whole = {e["microbatch"]: e["tokens"] for e in read_events(one_rank) if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in grid[0]["owners"].items()}
    assert set(tokens) == {(g, j, i) for g, mbs in owners.items() for i in mbs for j in range(4)}
    for g, mbs in owners.items():
        for i in mbs:
            rows = {k: {tokens[g, j, i] for j in range(4) if shard[j] == k} for k in (0, 1)}
            assert all(len(r) == 1 for r in rows.values()), rows  # a shard's ranks: the same rows
            assert sum(r.pop() for r in rows.values()) == whole[i], (layout, g, i)


def test_a_rank_killed_takes_its_group_out_and_its_restart_rejoins_healed_rank_by_rank(tmp_path, reference):
    """run.restarts=1: rank 1 of group 1 (FSDP shard 0's TP index 1, or stage 0's shard 1) dies after its
    first forward of step 2. Group 1 leaves, group 0 redoes its microbatch, torchrun restarts group 1's 4
    workers, and they are admitted at a step boundary, each rank healed from group 0's rank of the same
    index; the run ends with both groups and group 1's quota back, every step's digest the failure-free
    run's. Group 0 sleeps ~2 s a step (wall time only) so that the restart finds steps left: 0.6 s after
    each microbatch's compute, or 2 s after its pipeline schedule (one compute span for the whole batch).
    Measured beside each other (pytest -n 2), with 0.4 s and 1.2 s: fsdp x tp healed at step 8 of 20,
    11 s after the kill and 12 s before the run's end; pp x fsdp at step 14, 19.6 s after the kill (its
    workers restarted 14 s after it) and 8 s before the end; and pp x fsdp at 0.4 s a schedule (0.5-0.7 s
    steps) found the run over 14 s after the kill, its group not yet back."""
    layout, run = reference
    pause = 2.0 if layout.startswith("pp") else 0.6
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=2,phase=compute; slow:replica=0,from=0,for={pause}",
                             "--run.restarts=1", base=LAYOUTS[layout])
    fired = [e for e in events if e["event"] == "fault" and e.get("kind") == "kill"]
    assert [(e["replica"], e["rank"], e["step"], e["phase"]) for e in fired] == [(1, 1, 2, "compute")]
    assert 1 in [e["replica"] for e in events if e["event"] == "member_dead"]
    record = steps(events)
    assert record[2]["members"] == [0] and record[2]["ranks"] == 4 and sorted(record[2]["owners"]["0"]) == [0, 1, 2]
    assert next(e for e in events if e["event"] == "join")["replica"] == 1
    heals = [e for e in events if e["event"] == "heal"]
    assert sorted((e["side"], e["rank"]) for e in heals) == \
        [(side, j) for side in ("donor", "joiner") for j in range(4)], heals
    healed = heals[0]["step"]
    assert all(e["step"] == healed and e["donor"] == 0 and e["bytes"] > 0 for e in heals), heals
    assert healed < N - 1 and record[healed + 1]["members"] == record[N - 1]["members"] == [0, 1]
    assert record[healed + 1]["ranks"] == 8 and record[healed + 1]["owners"]["1"]  # its quota back
    assert digests(out) == digests(run)


@pytest.mark.timeout(300)
def test_all_three_degrees_in_one_group_stay_on_the_trajectory_through_a_rank_s_loss(tmp_path, one_rank):
    """2 groups of 8 ranks, `--parallel.group_size=8 --parallel.pp=2 --parallel.tp=2`: torchtitan's
    (pp, dp_shard, tp) mesh, rank = (stage x 2 + FSDP shard) x 2 + TP index, TP first and FSDP2 over it in
    each stage. Failure-free, its first 3 losses are within 1e-5 of the one-rank run's (measured: equal to
    the pp x fsdp run's to the bit, 1.2e-7 from the one-rank run's); rank 5 (stage 1, shard 0, TP index 1)
    of group 1 killed in step 1's compute takes its group out, group 0 redoes its microbatch through its
    own 8 ranks, and every step's digest is the failure-free run's. 16 trainers on this host's 2 cores:
    3 steps, and a 4 s heartbeat timeout (their start-up competes with the heartbeats). Measured alone:
    33 s a run."""
    at = COMMON.index("--steps") + 1
    args = [*COMMON[:at], "3", *COMMON[at + 1:], "--parallel.group_size=8", "--parallel.pp=2", "--parallel.tp=2",
            "--coord.heartbeat_timeout=4.0", "--coord.heartbeat_interval=0.2"]
    reference = tmp_path / "reference"
    r = unbroken("train", *args, "--out", str(reference))
    assert r.returncode == 0, r.stderr[-2000:]
    three, dp = steps(read_events(reference)), steps(read_events(one_rank))
    assert sorted(three) == [0, 1, 2] and all(three[s]["ranks"] == 16 for s in three)
    drift = [abs(three[s]["loss"] - dp[s]["loss"]) / dp[s]["loss"] for s in three]
    assert max(drift) <= 1e-5, drift
    topology = Config.from_json((reference / "config.json").read_text()).topology()
    assert [topology.coords(j) for j in (0, 5, 7)] == [(0, 0, 0), (1, 0, 1), (1, 1, 1)]
    out, events = run_faults(tmp_path, "kill:replica=1,rank=5,step=1,phase=compute", base=args)
    fired = [e for e in events if e["event"] == "fault"]
    assert [(e["replica"], e["rank"], e["step"], e["phase"]) for e in fired] == [(1, 5, 1, "compute")]
    assert 1 in [e["replica"] for e in events if e["event"] == "member_dead"]
    record = steps(events)
    assert record[1]["members"] == [0] and record[1]["ranks"] == 8 and sorted(record[1]["owners"]["0"]) == [0, 1, 2]
    assert digests(out) == digests(reference)
