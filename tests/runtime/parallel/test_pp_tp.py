"""Replica groups of two pipeline stages (`--parallel.pp=2`: rank 0 holds the embeddings and the first
block, rank 1 the second block, the final norm and the tied head) or of two tensor-parallel ranks
(`--parallel.tp=2`: each block's heads and MLP units split), each group a real `torchrun` job of the local
launcher, 2 groups, in `--exact`. Pipeline: the failure-free trajectory is bitwise the one-rank run's, and
a rank killed mid-pipeline takes its group out while the survivors redo its microbatches through their own
pipeline and stay on that trajectory. Tensor parallel: within float32 tolerance of the one-rank run (its
row-wise layers add the ranks' partial sums: other float32 sums), and bitwise its own failure-free run
through a rank killed mid-step.

The step record's digest is the sha256 of the stages' digests (each rank hashes its own stage); the oracle
(`plain_loop` of test_groups.py, whole microbatches) hashes its parameters in both layouts, so one oracle
run ties the pipeline run and the one-rank run together bit for bit.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import xxhash

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import assert_group_left, digests, plain_loop, run_faults
from unbroken.config import Config
from unbroken.events import read_events, steps
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.parallelize import peer_lost
from unbroken.runtime.parallel.pipeline import split

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

COMMON = ["--replicas", "2", "--steps", "4", "--microbatches", "3", "--exact", "--run.progress=false",
          "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=150",
          "--model.dropout=0"]
# dropout 0: each stage draws its masks from the microbatch's seed, where one model draws them in one stream.
# 3 microbatches over 2 groups: quotas of 2 (a 1F1B schedule) and 1 (GPipe: 1F1B needs one per stage)
PIPELINE = [*COMMON, "--parallel.group_size=2", "--parallel.pp=2"]
TENSOR = [*COMMON, "--parallel.group_size=2", "--parallel.tp=2"]
BOTH = [*COMMON, "--parallel.group_size=4", "--parallel.pp=2", "--parallel.tp=2"]  # rank = stage x 2 + tp index


def train(tmp_path_factory, name: str, args: list[str]) -> Path:
    out = tmp_path_factory.mktemp(name)
    r = unbroken("train", *args, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "pipeline-reference", PIPELINE)


@pytest.fixture(scope="module")
def tensor_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "tensor-reference", TENSOR)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The same config in 2 groups of one rank: plain data parallelism."""
    return train(tmp_path_factory, "one-rank", COMMON)


def whole(model: GPT) -> str:
    """A one-rank record's digest: XXH3-128 of every parameter's float32 bytes, in order."""
    return xxhash.xxh3_128(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def staged(stages: int):
    """A pipeline record's digest of a whole model: sha256 of each stage's digest, its parameters as
    `split` leaves them on that rank (the last stage's head holds the tied embedding)."""
    def digest(model: GPT) -> str:
        shards = [whole(split(copy.deepcopy(model), j, stages)[0]) for j in range(stages)]
        return hashlib.sha256("".join(shards).encode()).hexdigest()
    return digest


def test_failure_free_pipeline_is_bitwise_the_one_rank_run(pipeline_reference, one_rank):
    """At every step: the PP=2 run's digest is the oracle's in stage layout, the one-rank run's (2 groups of
    one rank, same config) is the same oracle's in one piece, and the two runs' losses are equal floats."""
    cfg = assert_stages_bitwise(pipeline_reference, one_rank, 2)
    want_whole, _, _ = plain_loop(cfg, split=False, digest=whole)
    assert [digests(one_rank)[s] for s in range(cfg.run.steps)] == want_whole


def assert_stages_bitwise(run: Path, one_rank: Path, stages: int) -> Config:
    """A failure-free pipeline run of 2 groups x `stages`: its digests are the oracle's cut into stages, its
    losses the one-rank run's, the same floats, with the same owners; each rank computed every microbatch
    of its group's quota (step 0). Returns its config."""
    cfg = Config.from_json((run / "config.json").read_text())
    assert (cfg.parallel.group_size, cfg.parallel.pp) == (stages, stages)
    want_staged, _, _ = plain_loop(cfg, split=False, digest=staged(stages))
    assert [digests(run)[s] for s in range(cfg.run.steps)] == want_staged
    pp, dp = steps(read_events(run)), steps(read_events(one_rank))
    assert [pp[s]["loss"] for s in range(cfg.run.steps)] == [dp[s]["loss"] for s in range(cfg.run.steps)]
    assert all(pp[s]["ranks"] == 2 * stages and pp[s]["owners"] == dp[s]["owners"] for s in pp)
    computed = {(e["replica"], e["rank"], e["microbatch"]) for e in read_events(run)
                if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in pp[0]["owners"].items()}
    assert computed == {(g, j, i) for g, mbs in owners.items() for i in mbs for j in range(stages)}
    return cfg


def test_a_stage_killed_mid_pipeline_takes_its_group_out_and_survivors_redo_its_microbatches(
        tmp_path, pipeline_reference):
    """Rank 1 (the last stage) of group 1 dies after its first forward of step 2, with the pipeline in flight:
    the coordinator removes group 1, group 0 redoes its microbatches through its own two stages into the
    intact accumulator, and every step's digest equals the failure-free run's (the "drop" plan)."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=2,phase=compute", base=PIPELINE)
    assert_group_left(events, 1, 1, 2, "compute")
    record = steps(events)
    assert record[2]["members"] == [0] and record[2]["ranks"] == 2
    assert sorted(record[2]["owners"]["0"]) == [0, 1, 2]
    recovery = [e for e in events if e["event"] == "recovery" and e["step"] == 2 and e["replica"] == 0]
    assert sorted(e["rank"] for e in recovery) == [0, 1] and all(e["redo"] == [2] for e in recovery), recovery
    redone = {(e["rank"], e["microbatch"]) for e in events
              if e["event"] == "compute" and e["step"] == 2 and e["replica"] == 0}
    assert redone == {(j, i) for j in range(2) for i in range(3)}  # both stages ran the redone ones too
    assert digests(out) == digests(pipeline_reference)


def test_failure_free_tensor_parallel_is_within_float32_tolerance_of_the_one_rank_run(tensor_reference, one_rank):
    """Every step's loss within 1e-6 (relative) of the one-rank run's; measured: equal floats at steps 0-2,
    2.6e-8 at step 3 (the first loss computed from parameters that TP's other sums moved). Both ranks of a
    group compute every microbatch of its quota, whole, each with its own heads and units."""
    tp, dp = steps(read_events(tensor_reference)), steps(read_events(one_rank))
    assert sorted(tp) == sorted(dp) == list(range(4))
    drift = [abs(tp[s]["loss"] - dp[s]["loss"]) / dp[s]["loss"] for s in sorted(dp)]
    assert max(drift) <= 1e-6, drift
    assert all(tp[s]["ranks"] == 4 and tp[s]["owners"] == dp[s]["owners"] for s in tp)
    computed = {(e["replica"], e["rank"], e["microbatch"], e["tokens"]) for e in read_events(tensor_reference)
                if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in tp[0]["owners"].items()}
    whole_tokens = {e["microbatch"]: e["tokens"] for e in read_events(one_rank)
                    if e["event"] == "compute" and e["step"] == 0}
    assert computed == {(g, j, i, whole_tokens[i]) for g, mbs in owners.items() for i in mbs for j in range(2)}


def test_a_tensor_parallel_rank_killed_mid_step_takes_its_group_out_on_the_same_trajectory(
        tmp_path, tensor_reference):
    """Rank 0 of group 1 dies after its first microbatch of step 2 (its peer is then stuck in a TP
    all-reduce or killed by torchrun): group 1 leaves, group 0 redoes its microbatch, and every step's
    digest equals the failure-free TP run's."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=0,step=2,phase=compute", base=TENSOR)
    assert_group_left(events, 1, 0, 2, "compute")
    record = steps(events)
    assert record[2]["members"] == [0] and sorted(record[2]["owners"]["0"]) == [0, 1, 2]
    assert digests(out) == digests(tensor_reference)


def test_a_peer_lost_under_a_pipeline_stage_s_wrapper_is_a_peer_lost():
    """A TP all-reduce inside a stage's backward that found its peer gone reaches the trainer wrapped by
    torch.distributed.pipelining ("Failed to run stage backward", the gloo error as its cause): still the
    group's loss, not a bug of this rank (which would exit 1 and end the run); a plain error stays one."""
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8400")
    try:
        try:
            raise gone
        except RuntimeError as e:
            raise RuntimeError("\n        Failed to run stage backward:\n        Output gradient: None") from e
    except RuntimeError as wrapped:
        assert peer_lost(wrapped) and peer_lost(gone)
    assert not peer_lost(RuntimeError("Failed to run stage backward: shape mismatch"))
    assert not peer_lost(ValueError("Connection closed"))


def test_tensor_parallel_pipeline_stages_lose_a_rank_and_stay_within_float32_tolerance(tmp_path, one_rank):
    """2 groups of 4 ranks, TP inside pipeline stages (torchtitan's (pp, tp) mesh: stage s's TP rank t feeds
    stage s+1's TP rank t). Rank 3 (stage 1, TP index 1) of group 1 dies after its first forward of step 2:
    group 1 leaves, group 0 redoes its microbatch through its own 4 ranks, and every step's loss stays
    within 1e-6 (relative) of the one-rank run's (TP's partial sums: other float32 sums; measured: equal
    floats in a failure-free run of 3 steps, one group)."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=3,step=2,phase=compute", base=BOTH)
    assert_group_left(events, 1, 3, 2, "compute")
    both, dp = steps(events), steps(read_events(one_rank))
    assert sorted(both) == sorted(dp) == list(range(4))
    drift = [abs(both[s]["loss"] - dp[s]["loss"]) / dp[s]["loss"] for s in sorted(dp)]
    assert max(drift) <= 1e-6, drift
    assert both[0]["ranks"] == 8 and both[0]["owners"] == dp[0]["owners"]
    assert both[2]["members"] == [0] and sorted(both[2]["owners"]["0"]) == [0, 1, 2]
    # every rank of an owning group computed each of its microbatches (its stage, its heads and units)
    computed = {(e["replica"], e["rank"], e["microbatch"]) for e in events if e["event"] == "compute" and e["step"] == 0}
    owners = {int(g): mbs for g, mbs in both[0]["owners"].items()}
    assert computed == {(g, j, i) for g, mbs in owners.items() for i in mbs for j in range(4)}
    redone = {(e["rank"], e["microbatch"]) for e in events
              if e["event"] == "compute" and e["step"] == 2 and e["replica"] == 0}
    assert redone == {(j, i) for j in range(4) for i in range(3)}


@pytest.mark.parametrize("layout, slow, n", [("pp", 20, 40), ("tp", 6, 30)])
def test_a_group_restarted_by_torchrun_rejoins_healed_rank_by_rank(tmp_path, layout, slow, n):
    """run.restarts=1: rank 1 of group 1 is killed in step 2, torchrun restarts the group, it is admitted
    at a step boundary and each of its ranks takes its stage (or slices) and optimizer state from the
    donor's rank of the same index; the run ends with both groups, every step on the failure-free
    trajectory: the oracle's for PP, a failure-free TP run's for TP. The survivor's rank 0 sleeps through
    `slow` x its compute (how=sleep: wall time only, no CPU, and its quotas and digests do not move), so
    `n` steps outlast the restart. A PP group's window was 60 steps at 6x (~0.15 s a step), and under
    CI's load the restarted group once found the run over; at 20x a step takes ~0.5 s. Measured on a
    quiet host: a PP group healed 4 s after the kill with 20 s of steps left, a TP group (6x: its steps
    compute more) 4.5 s after it with 12 s left of 24 steps (TP runs 30)."""
    base = PIPELINE if layout == "pp" else TENSOR
    at = base.index("--steps") + 1
    args = [*base[:at], str(n), *base[at + 1:]]
    out = tmp_path / "run"
    r = unbroken("train", *args, "--run.restarts=1", "--out", str(out),
                 "--faults", f"kill:replica=1,rank=1,step=2,phase=compute;slow:replica=0,from=0,factor={slow}")
    assert r.returncode == 0, r.stderr[-2000:]
    audit = unbroken("audit", str(out))
    assert audit.returncode == 0 and "audit: 0 problems" in audit.stdout, audit.stdout + audit.stderr
    events = read_events(out)
    assert (next(e for e in events if e["event"] == "join")["replica"]) == 1
    heals = [e for e in events if e["event"] == "heal"]
    assert sorted((e["side"], e["rank"]) for e in heals) == [("donor", 0), ("donor", 1), ("joiner", 0), ("joiner", 1)]
    record = steps(events)
    healed = heals[0]["step"]
    assert record[2]["members"] == [0] and record[healed + 1]["members"] == record[n - 1]["members"] == [0, 1]
    assert record[healed + 1]["owners"]["1"] == [2]  # its quota back
    cfg = Config.from_json((out / "config.json").read_text())
    if layout == "pp":
        want, _, _ = plain_loop(cfg, split=False, digest=staged(2))
        assert [digests(out)[s] for s in range(n)] == want
    else:
        reference = tmp_path / "reference"
        r = unbroken("train", *args, "--out", str(reference))
        assert r.returncode == 0, r.stderr[-2000:]
        assert digests(out) == digests(reference)
