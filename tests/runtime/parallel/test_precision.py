"""bf16 mixed precision and activation checkpointing through the product's launcher: a bf16 run of
2 groups x 2 ranks (FSDP2 inside) is bitwise its own failure-free bf16 run through a rank kill and the
group's rejoin; bf16 lands within 2% of float32's loss on another trajectory (2 x 2 FSDP2 groups after 8
steps, one-rank groups after 20, a TP group under autocast after 3); checkpointing ("full", "selective") keeps every step's digest
and lowers the activations a forward keeps for its backward; bad input is one line and exit 2.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import unbroken
from unbroken.config import ModelConfig
from unbroken.events import read_events, steps
from unbroken.model.gpt import GPT
from unbroken.runtime.parallel.precision import checkpoint_layers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BASE = ["--run.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
        "--coord.run_timeout=300"]


def train(tmp: Path, name: str, *args: str, timeout: float = 300) -> tuple[Path, list[dict]]:
    """A run of `args` that succeeds: its directory and events."""
    out = tmp / name
    r = unbroken("train", *BASE, *args, "--out", str(out), timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, read_events(out)


def digests(events: list[dict]) -> dict[int, str]:
    return {s: r["param_digest"] for s, r in steps(events).items()}


def test_bf16_groups_of_two_through_a_kill_and_rejoin_match_the_failure_free_bf16_run(tmp_path):
    """2 groups x 2 ranks, FSDP2 in bf16 (--exact: the float64 reduction makes redone microbatches exact):
    rank 1 of group 1 is killed in step 2's compute, torchrun restarts its group, which rejoins healed
    from group 0; every step's digest is the failure-free bf16 run's."""
    args = ["--replicas", "2", "--parallel.group_size=2", "--steps", "32", "--microbatches", "4", "--exact",
            "--parallel.mixed_precision=bf16"]
    _, clean = train(tmp_path, "clean", *args)
    # the survivor must still be training when torchrun's restart is back (as test_groups' rejoin holds it)
    hold = "slow:replica=0,from=3,to=28,factor=6"
    out, events = train(tmp_path, "killed", *args, "--run.restarts=1", "--faults",
                        f"kill:replica=1,rank=1,step=2,phase=compute; {hold}")
    audit = unbroken("audit", str(out))
    assert audit.returncode == 0 and "audit: 0 problems" in audit.stdout, audit.stdout + audit.stderr
    kills = [(e["replica"], e.get("rank"), e["step"]) for e in events
             if e["event"] == "fault" and e.get("kind") == "kill"]
    assert kills == [(1, 1, 2)], kills
    assert 1 in [e["replica"] for e in events if e["event"] == "member_dead"]
    join = next(e for e in events if e["event"] == "join")
    assert (join["replica"], join["restart"]) == (1, 1), join
    heals = sorted((e["side"], e["rank"]) for e in events if e["event"] == "heal")
    assert heals == [("donor", 0), ("donor", 1), ("joiner", 0), ("joiner", 1)], heals
    record = steps(events)
    assert record[2]["members"] == [0] and record[31]["members"] == [0, 1]
    assert digests(events) == digests(clean) and len(digests(clean)) == 32
    # and bf16 is what the groups computed: float32's steps took other parameters, and after 8 steps its
    # loss is within 2% of the bf16 groups'
    _, fp32 = train(tmp_path, "fp32", "--replicas", "2", "--parallel.group_size=2", "--steps", "8",
                    "--microbatches", "4", "--exact")
    assert all(digests(fp32)[s] != digests(clean)[s] for s in range(8))
    a, b = steps(fp32)[7]["loss"], record[7]["loss"]
    print(f"2 x 2 FSDP2 groups, loss after 8 steps: float32 {a:.6f}, bf16 {b:.6f} ({abs(b - a) / a:.3%} apart)")
    assert abs(b - a) <= 0.02 * a, (a, b)


def test_bf16_with_tensor_parallelism_runs_under_autocast(tmp_path):
    """A TP group without FSDP2 shards (tp=2) computes under autocast: within 2% of float32's loss after
    3 steps, on other parameters."""
    args = ["--replicas", "1", "--parallel.group_size=2", "--parallel.tp=2", "--steps", "3", "--microbatches", "2"]
    _, fp32 = train(tmp_path, "fp32", *args)
    _, bf16 = train(tmp_path, "bf16", *args, "--parallel.mixed_precision=bf16")
    a, b = steps(fp32)[2]["loss"], steps(bf16)[2]["loss"]
    assert abs(b - a) <= 0.02 * a, (a, b)
    assert all(digests(fp32)[s] != digests(bf16)[s] for s in range(3))


def test_bf16_lands_within_2_percent_of_float32_on_another_trajectory(tmp_path):
    """One-rank groups (autocast): after 20 steps the bf16 loss is within 2% of float32's, and the
    digests differ from the first step on (bf16 did compute)."""
    args = ["--replicas", "2", "--steps", "20", "--microbatches", "4"]
    _, fp32 = train(tmp_path, "fp32", *args)
    _, bf16 = train(tmp_path, "bf16", *args, "--parallel.mixed_precision=bf16")
    a, b = steps(fp32)[19]["loss"], steps(bf16)[19]["loss"]
    print(f"loss after 20 steps: float32 {a:.6f}, bf16 {b:.6f} ({abs(b - a) / a:.3%} apart)")
    assert abs(b - a) <= 0.02 * a, (a, b)
    assert steps(fp32)[0]["loss"] > a  # it trained
    assert all(digests(fp32)[s] != digests(bf16)[s] for s in range(20))


@pytest.mark.parametrize("layout", [[], ["--parallel.group_size=2"],
                                    ["--parallel.group_size=2", "--parallel.tp=2"],
                                    ["--parallel.group_size=2", "--parallel.pp=2", "--model.dropout=0"]],
                         ids=["one-rank", "fsdp2", "tp", "pp"])
def test_activation_checkpointing_keeps_every_digest(tmp_path, layout):
    """"full" and "selective" give the step digests of "none" (dropout on: the recompute replays each
    block's RNG state), in one-rank groups and in groups of two: FSDP2 (checkpointing inside each block's
    FSDP2 unit), tensor parallel (after TP's split) and pipeline stages (each stage's blocks)."""
    args = ["--replicas", "1" if layout else "2", *layout, "--steps", "3", "--microbatches", "4"]
    logs = {mode: train(tmp_path, mode, *args, f"--model.activation_checkpointing={mode}")[1]
            for mode in ("none", "full", "selective")}
    runs = {mode: digests(events) for mode, events in logs.items()}
    assert len(runs["none"]) == 3
    assert runs["full"] == runs["none"] and runs["selective"] == runs["none"], runs
    # it took effect: each rank says which of the blocks it holds recompute (a run that ignored the key
    # would log none), every block under "full", every other one of those it holds under "selective"
    assert not [e for e in logs["none"] if e["event"] == "checkpointing"]
    for mode in ("full", "selective"):
        said = {(e["replica"], e.get("rank", 0)): e["blocks"] for e in logs[mode] if e["event"] == "checkpointing"}
        held = {(e["replica"], e.get("rank", 0)): e["stack"] for e in logs[mode] if e["event"] == "parallelized"}
        ranks = 2 if layout else 1
        assert len(said) == 2 * ranks if not layout else len(said) == ranks, said
        for who, blocks in said.items():
            stack = held.get(who, ["0", "1"])
            # every other block of the whole model (1, 3, ...), whichever stage holds it
            assert blocks == (stack if mode == "full" else [k for k in stack if int(k) % 2]), (mode, who, blocks, stack)
        print(f"{mode}: blocks recomputed per (replica, rank): {said}")


def test_activation_checkpointing_in_a_group_is_bitwise_through_a_rank_kill(tmp_path):
    """2 groups x 2 ranks (FSDP2), "full" checkpointing, --exact: rank 1 of group 1 is killed in step 2's
    compute and its group leaves; every step's digest is the failure-free checkpointed run's, and every
    rank said it recomputes both blocks."""
    args = ["--replicas", "2", "--parallel.group_size=2", "--steps", "5", "--microbatches", "4", "--exact",
            "--model.activation_checkpointing=full"]
    _, clean = train(tmp_path, "clean", *args)
    _, events = train(tmp_path, "killed", *args, "--faults", "kill:replica=1,rank=1,step=2,phase=compute")
    kills = [(e["replica"], e.get("rank"), e["step"]) for e in events if e["event"] == "fault"]
    assert kills == [(1, 1, 2)], kills
    assert [e["replica"] for e in events if e["event"] == "member_dead"] == [1]
    said = sorted((e["replica"], e.get("rank", 0), tuple(e["blocks"])) for e in events if e["event"] == "checkpointing")
    assert said == [(0, 0, ("0", "1")), (0, 1, ("0", "1")), (1, 0, ("0", "1")), (1, 1, ("0", "1"))], said
    assert digests(events) == digests(clean) and len(digests(clean)) == 5


def saved_for_backward_mib(mode: str) -> float:
    """MiB of activations one microbatch's forward keeps for its backward (n_layer 4, n_embd 256,
    block_size 256, batch 8), counted by a saved-tensors hook around the forward: every tensor autograd
    saves, each storage once, parameters left out. A checkpointed block's own hook takes its inner tensors
    (it keeps only its inputs and recomputes the rest), so they never reach this one. In-process and
    deterministic: what checkpointing exists to cut, without the allocator's and the host's noise that a
    resident-memory high-water mark carries on a shared machine."""
    torch.manual_seed(0)
    model = checkpoint_layers(GPT(ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=256)), mode)
    x = torch.randint(0, 256, (8, 256))
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter):
            seen.add((storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()  # and the recompute works
    return sum(n for _, n in seen) / 2**20


def test_activation_checkpointing_lowers_the_memory_kept_for_backward():
    """full < selective < none, by a wide margin (each checkpointed block keeps its input only)."""
    kept = {mode: saved_for_backward_mib(mode) for mode in ("none", "selective", "full")}
    print("MiB kept for backward by one forward: " + ", ".join(f"{m} {v:.1f}" for m, v in kept.items()))
    assert kept["full"] < 0.5 * kept["selective"] < 0.5 * kept["none"], kept


@pytest.mark.parametrize("args, token", [
    (["--parallel.mixed_precision=fp8"], "parallel.mixed_precision='fp8'"),
    (["--model.activation_checkpointing=some"], "model.activation_checkpointing='some'"),
    (["--parallel.mixed_precision=bf16", "--parallel.group_size=2", "--parallel.pp=2", "--parallel.on_rank_loss=replan"],
     "parallel.on_rank_loss=replan"),
])
def test_bad_precision_input_is_one_line_and_exit_2(tmp_path, args, token):
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--steps", "2", *args, "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and token in r.stderr, r.stderr
    assert not (out / "events.jsonl").exists()
