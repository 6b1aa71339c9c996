"""Replica groups of 4 ranks with FSDP2 beside tensor parallelism (`--parallel.group_size=4 --parallel.tp=2`):
torchtitan's 2-D (dp_shard, tp) mesh, TP innermost, so ranks 0-1 are FSDP shard 0's TP team and take its
rows of each microbatch, ranks 2-3 shard 1's. 2 groups, each a real `torchrun` job of the local launcher,
in `--exact`, dropout 0 (masks drawn for a shard's rows are not the whole microbatch's).

The failure-free run stays within float32 tolerance of the one-rank run (TP's row-wise layers add the
ranks' partial sums: other float32 sums); a rank killed mid-step takes its group out, the survivors redo
its microbatch, torchrun restarts the group, and it rejoins with each of its 4 ranks healed from the
donor's rank of the same index (its 2-D DTensor piece and optimizer state), every step's digest that of
the failure-free run of the same topology. `test_pp_tp_persist.py` restarts such groups from disk.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_groups import digests, run_faults
from tests.runtime.test_pp_tp import train
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

N = 20  # steps: the kill at step 2, then torchrun's restart of 4 workers and the heal, with steps to spare
COMMON = ["--replicas", "2", "--steps", str(N), "--microbatches", "3", "--exact", "--run.progress=false",
          "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=170",
          "--model.dropout=0"]
GRID = [*COMMON, "--parallel.group_size=4", "--parallel.tp=2"]  # rank = FSDP shard x 2 + TP index


@pytest.fixture(scope="module")
def grid_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "grid-reference", GRID)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The same config in 2 groups of one rank: plain data parallelism."""
    return train(tmp_path_factory, "one-rank", COMMON)


def test_failure_free_fsdp_beside_tp_is_within_float32_tolerance_of_the_one_rank_run(grid_reference, one_rank):
    """Every step's loss within 2e-6 (relative; measured: at most 2.1e-7 over 20 steps) of the one-rank
    run's, with the same owners; each TP team computed its FSDP shard's rows of each microbatch of its
    group's quota (both ranks of a team the same rows), and the two shards' rows make up the whole microbatch."""
    grid, dp = steps(read_events(grid_reference)), steps(read_events(one_rank))
    assert sorted(grid) == sorted(dp) == list(range(N))
    drift = [abs(grid[s]["loss"] - dp[s]["loss"]) / dp[s]["loss"] for s in sorted(dp)]
    assert max(drift) <= 2e-6, drift
    assert all(grid[s]["ranks"] == 8 and grid[s]["owners"] == dp[s]["owners"] for s in grid)
    tokens = {(e["replica"], e["rank"], e["microbatch"]): e["tokens"] for e in read_events(grid_reference)
              if e["event"] == "compute" and e["step"] == 0}
    whole = {e["microbatch"]: e["tokens"] for e in read_events(one_rank) if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in grid[0]["owners"].items()}
    assert set(tokens) == {(g, j, i) for g, mbs in owners.items() for i in mbs for j in range(4)}
    for g, mbs in owners.items():
        for i in mbs:
            assert tokens[g, 0, i] == tokens[g, 1, i] and tokens[g, 2, i] == tokens[g, 3, i]  # a TP team: same rows
            assert tokens[g, 0, i] + tokens[g, 2, i] == whole[i] and 0 < tokens[g, 0, i] < whole[i]


def test_a_rank_killed_takes_its_group_out_and_its_restart_rejoins_healed_rank_by_rank(tmp_path, grid_reference):
    """run.restarts=1: rank 1 (shard 0, TP index 1) of group 1 dies after its first microbatch of step 2.
    Group 1 leaves, group 0 redoes its microbatch, torchrun restarts group 1's 4 workers, and they are
    admitted at a step boundary, each rank healed from group 0's rank of the same index; the run ends with
    both groups and group 1's quota back, every step's digest the failure-free run's. Group 0 sleeps 0.4 s
    after each microbatch (wall time only) so that the restart finds steps left: measured on a quiet
    host, healed at step 7 of 16 (6.6 s after the kill) with 0.3 s; at 0.4 s beside another test, at step
    6 of 20 (7.2 s after it), 14 s before the run's end."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=2,phase=compute; slow:replica=0,from=0,for=0.4",
                             "--run.restarts=1", base=GRID)
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
    assert digests(out) == digests(grid_reference)
