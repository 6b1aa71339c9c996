"""The built-in Llama (`--model.arch=llama`, grouped-query attention: 4 heads, 2 KV heads) through real
torchrun groups of the local launcher, 2 groups, `--exact`, its parallel plan applied as the GPT's is:
FSDP2 (one unit per block plus the root: tests/model/test_llama.py), TP=2, PP=2 and PP x TP = 2 x 2.

An oracle outside unbroken, written here (one process, plain PyTorch, float64 accumulation, AdamW from
tests/oracle.py), is the one-rank-group run bit for bit. Per layout, rank 1 of group 1 is killed in step 2
and torchrun restarts the group, which rejoins healed rank by rank; every digest is then the failure-free
trajectory of that layout: the oracle's for FSDP2 (its rows split into the ranks' shares) and PP (cut
into stages: PP is bitwise the one-rank run), a failure-free run's for TP and PP x TP, which stay within
float32 tolerance (1e-6 relative on the loss) of the one-rank run: a row-wise layer adds the ranks'
partial sums. And a pipeline group re-forms (`--parallel.on_rank_loss=replan`) onto its survivor from the
Llama's plan, bitwise on the oracle's trajectory.

Through the Python API, in 2 groups of 2 ranks: a user's torchtitan-style parallelize function (its FSDP2
units reported; under replan a killed rank's group is dropped, not re-formed, saying why), and a user's own
plan handing the model document positions in a pipeline (every stage gets them), each on the oracle's
trajectory.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash

from tests.conftest import unbroken
from tests.oracle import adamw
from tests.runtime.trainer.test_groups import digests, run_faults
from tests.runtime.parallel.test_pp_tp import train
from tests.runtime.trainer.test_shrink import HOLD, one
from unbroken.config import Config
from unbroken.events import read_events, steps
from unbroken.model.data import DataSource
from unbroken.model.llama import Llama
from unbroken.runtime.parallel.pipeline import split

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 14  # steps: the restarted group (torchrun's restart and the heal: 2.3-2.9 s after the kill, measured
# on a quiet host) rejoins while group 0 is held (steps 0-7, below), and 6 quick steps follow
COMMON = ["--replicas", "2", "--steps", str(N), "--microbatches", "3", "--exact", "--run.progress=false",
          "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200",
          "--coord.progress_timeout=120", "--model.arch=llama", "--model.n_kv_head=2"]
# 3 microbatches over 2 groups: quotas of 2 (a 1F1B schedule) and 1 (GPipe); a layout's ranks, and how
# long the surviving group 0 sleeps through each compute of steps 0-7 (how=sleep: wall time only) so that
# the restart lands with steps left: measured at 1.7x these factors, the heal landed 1.7-7 s after the
# kill, 14-20 s before step 8
LAYOUTS = {
    "fsdp": (["--parallel.group_size=2"], 6),
    "tp": (["--parallel.group_size=2", "--parallel.tp=2"], 4),
    "pp": (["--parallel.group_size=2", "--parallel.pp=2"], 12),
    "pp x tp": (["--parallel.group_size=4", "--parallel.pp=2", "--parallel.tp=2"], 8),
}
# pp x tp restarts 4 ranks: with other work loading the host, its group was once not a member of the step
# after its heal (the step the test asserts it computes); a longer hold leaves a late heal held steps to
# be admitted in (8x: +8 s on a quiet host)


def whole(model: Llama) -> str:
    """A one-rank record's digest: XXH3-128 of every parameter's float32 bytes, in order."""
    return xxhash.xxh3_128(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def staged(stages: int) -> Callable[[Llama], str]:
    """A pipeline record's digest: sha256 of each stage's digest, its parameters as the plan's split leaves
    them on that rank."""
    def digest(model: Llama) -> str:
        return hashlib.sha256("".join(whole(split(copy.deepcopy(model), j, stages)[0])
                                      for j in range(stages)).encode()).hexdigest()
    return digest


def sharded(shards: int) -> Callable[[Llama], str]:
    """An FSDP2 group's record digest: sha256 of each rank's digest of its torch.chunk rows of each parameter."""
    def digest(model: Llama) -> str:
        return hashlib.sha256("".join(
            xxhash.xxh3_128(b"".join(torch.chunk(p.detach(), shards)[j].contiguous().numpy().tobytes()
                                     for p in model.parameters())).hexdigest() for j in range(shards)).encode()
        ).hexdigest()
    return digest


def oracle(cfg: Config, shares: int = 1, digest: Callable[[Llama], str] = whole,
           build: Callable[[Config], torch.nn.Module] = lambda cfg: Llama(cfg.model),
           positions: bool = False) -> tuple[list[str], list[float]]:
    """The Llama (or the model `build` makes) trained by a plain loop: each microbatch (or each of its
    `shares` row shares, as an FSDP2 group's ranks compute them) forward and backward in float32, its
    gradients summed in float64 over the step and rounded to float32 once before AdamW; `positions`: each
    token's position in its document given to the forward. Returns each step's `digest` and loss."""
    torch.set_num_threads(1)
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed, microbatches=cfg.run.microbatches)
    torch.manual_seed(cfg.run.seed)
    model = build(cfg)
    params = [p for _, p in model.named_parameters()]
    opt = adamw(model, params, cfg.optim)
    out, losses = [], []
    for step in range(cfg.run.steps):
        total, loss = data.step_tokens(step, cfg.run.microbatches), 0.0
        acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for i in range(cfg.run.microbatches):
            mb = data.microbatch(step, i)
            rows = mb.x.shape[0] // shares
            for j in range(shares):
                x, y = mb.x[j * rows:(j + 1) * rows], mb.y[j * rows:(j + 1) * rows]
                extra = {"positions": mb.positions[j * rows:(j + 1) * rows]} if positions else {}
                weighted = model(x, y, **extra) * (int((y != -1).sum()) / total)
                weighted.backward()
                loss += float(weighted.detach())
                for a, p in zip(acc, params):
                    a += p.grad.double()
                    p.grad = None
        for a, p in zip(acc, params):
            p.grad = a.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(digest(model))
        losses.append(loss)
    return out, losses


def losses(run: Path) -> list[float]:
    record = steps(read_events(run))
    return [record[s]["loss"] for s in range(N)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "llama-one-rank", COMMON)


def test_the_one_rank_run_is_a_plain_pytorch_loop_bit_for_bit(one_rank):
    cfg = Config.from_json((one_rank / "config.json").read_text())
    want, _ = oracle(cfg)
    assert [digests(one_rank)[s] for s in range(N)] == want


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_rank_killed_and_its_group_restarted_by_torchrun_stays_on_the_layout_s_trajectory(
        tmp_path, one_rank, layout):
    """Rank 1 of group 1 dies in step 2's compute; torchrun restarts the group, it is admitted at a step
    boundary and each rank heals its part (stage, slices, shard) from the donor's rank of its index; the
    run ends with both groups, every digest the failure-free one of this layout."""
    extra, slow = LAYOUTS[layout]
    size = int(extra[0].split("=")[1])
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=2,phase=compute;slow:replica=0,from=0,"
                             f"to=8,factor={slow},how=sleep", *extra, "--run.restarts=1", base=COMMON)
    fired = [e for e in events if e["event"] == "fault" and e.get("kind") == "kill"]
    assert [(e["replica"], e["rank"], e["step"]) for e in fired] == [(1, 1, 2)]
    assert next(e for e in events if e["event"] == "join")["replica"] == 1
    heals = [e for e in events if e["event"] == "heal"]
    assert sorted((e["side"], e["rank"]) for e in heals) == [(s, j) for s in ("donor", "joiner") for j in range(size)]
    record = steps(events)
    healed = heals[0]["step"]
    assert record[2]["members"] == [0] and record[healed + 1]["members"] == record[N - 1]["members"] == [0, 1]
    cfg = Config.from_json((out / "config.json").read_text())
    if layout in ("fsdp", "pp"):  # bitwise on the oracle's trajectory: PP's is the one-rank run's
        want, _ = oracle(cfg, shares=size if layout == "fsdp" else 1,
                         digest=sharded(size) if layout == "fsdp" else staged(2))
        assert [digests(out)[s] for s in range(N)] == want
        if layout == "pp":
            assert losses(out) == losses(one_rank)
        return
    reference = tmp_path / "reference"
    r = unbroken("train", *COMMON, *extra, "--out", str(reference))
    assert r.returncode == 0, r.stderr[-2000:]
    assert digests(out) == digests(reference)
    drift = [abs(a - b) / b for a, b in zip(losses(reference), losses(one_rank))]
    assert max(drift) <= 1e-6, drift


@pytest.mark.alone  # as test_shrink.py's: the heal must land with shrunk steps left
def test_a_pipeline_group_re_forms_onto_its_survivor_from_the_llama_s_plan_bitwise(tmp_path):
    """--parallel.on_rank_loss=replan: rank 1 (the last stage) of group 1 dies in step 3; the scheduler
    chooses to shrink the group onto its survivor (logged), which stands in for both stages of the
    Llama's plan, healed stage by stage, and every digest stays the oracle's pipeline trajectory."""
    base = [*COMMON[:3], "16", *COMMON[4:], "--parallel.group_size=2", "--parallel.pp=2",
            "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1"]
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=3,phase=compute; {HOLD}", base=base)
    fault = one(events, "fault", kind="kill", replica=1, rank=1)
    assert (fault["step"], fault["phase"]) == (3, "compute")
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["decision"], plan["applied"], plan["alive"]) == ("shrink", "shrink", [0])
    assert plan["trajectory"].startswith("bitwise")
    heals = [e for e in events if e["event"] == "heal" and e["side"] == "joiner" and e.get("shrunk")
             and e["replica"] == 1]
    assert sorted(e["rank"] for e in heals) == [0, 1]
    stand_in = [e for e in events if e["event"] == "compute" and e["replica"] == 1 and e["step"] > heals[0]["step"]]
    assert stand_in and all(e.get("shards") == [0, 1] for e in stand_in)
    cfg = Config.from_json((out / "config.json").read_text())
    want, _ = oracle(cfg, digest=staged(2))
    assert [digests(out)[s] for s in range(16)] == want


USER_SCRIPT = '''
"""A user's script with a torchtitan-style parallelize function for the built-in Llama."""
import sys
import unbroken
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh, dims):
    for block in model.layers.values():  # one FSDP2 unit per transformer block, then the root
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=dims["mp_policy"])
    return fully_shard(model, mesh=mesh["dp_shard"], mp_policy=dims["mp_policy"])


if __name__ == "__main__":
    r = unbroken.train(parallelize=parallelize, replicas=2, steps=STEPS, microbatches=3, exact=True, progress=False,
                       out=sys.argv[1], parallel__group_size=2, model__arch="llama", model__n_kv_head=2,
                       coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1,
                       parallel__on_rank_loss="replan", faults=FAULTS)
    print("ok" if r.ok else "failed")
'''
USER_STEPS, USER_KILL = 4, 1
# group 0 computes 2 of the 3 microbatches: its rank 1 dies after the first, and its rank 0's all-gather
# for the second finds the group broken at once (not after a heartbeat timeout); the survivor asks to go
# on 0.3-0.5 s later (its release), and group 1 alone would finish steps 1-3 in under a second, so its rank
# 0 sleeps 0.7 s after each microbatch of step 2 while the coordinator decides (2.1 s: the decision came
# 0.3 s into that step here)
USER_FAULTS = (f"kill:replica=0,rank=1,step={USER_KILL},phase=compute;"
               f"slow:replica=1,from={USER_KILL + 1},to={USER_KILL + 2},for=0.7")


def test_a_user_s_torchtitan_style_parallelize_function_trains_on_the_oracle_s_trajectory(tmp_path):
    """unbroken.train(parallelize=fn): the user's function shards the Llama (FSDP2 per block, then the root)
    in 2 groups of 2 ranks; unbroken installs its reduce hooks after it, and every step's digest is the
    oracle's, each microbatch's rows split into the 2 ranks' shares. Under parallel.on_rank_loss=replan
    rank 1 of group 0 dies in step 1: re-forming would cut slices by the model's plan, which the function
    replaced, so the scheduler prices the shrink and applies drop, saying why (api.CUSTOM_REFUSED); group
    1 takes every microbatch from then on, on the same trajectory."""
    import os
    import subprocess
    import sys

    from unbroken.api import CUSTOM_REFUSED

    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT.replace("STEPS", str(USER_STEPS)).replace("FAULTS", repr(USER_FAULTS)))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=200, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]
    cfg = Config.from_json((out / "config.json").read_text())
    assert (cfg.parallel.group_size, cfg.run.steps, cfg.model.arch) == (2, USER_STEPS, "llama")
    events = read_events(out)
    units = [e["fsdp_units"] for e in events if e["event"] == "parallelized"]
    assert units == [["", "layers.0", "layers.1"]] * 4, units  # the function's: the root, then one per block
    fault = one(events, "fault", kind="kill", replica=0, rank=1)
    assert (fault["step"], fault["phase"]) == (USER_KILL, "compute")
    plan = one(events, "group_plan", replica=0, why="rank lost")
    assert (plan["applied"], plan["alive"], plan["not_executable"]["shrink"]) == ("drop", [0], CUSTOM_REFUSED), plan
    assert "shrink" in {o["kind"] for o in plan["options"]} and plan["trajectory"].startswith("bitwise")
    assert one(events, "shrink_refused", replica=0)["alive"] == [0]
    held = [e["wall"] for e in events if e["event"] == "compute" and e["replica"] == 1 and e.get("rank", 0) == 0
            and e["step"] == USER_KILL + 1]
    assert len(held) == 3 and min(held) >= 0.7, held  # the slow fault: its rank 0 0.7 s more on each microbatch
    record = steps(events)
    assert [record[s]["ranks"] for s in range(USER_STEPS)] == [4] * USER_KILL + [2] * (USER_STEPS - USER_KILL)
    want, _ = oracle(cfg, shares=2, digest=sharded(2))
    assert [digests(out)[s] for s in range(USER_STEPS)] == want


PLAN_SCRIPT = '''
"""A user's script: the built-in Llama under a parallel plan of the user's own, which also hands the model
each token's position in its document (`inputs`), in groups of 2 pipeline stages."""
import sys

import torch.nn.functional as F
import unbroken
from unbroken.model.plan import ParallelPlan, PipelinePlan


def loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


PLAN = ParallelPlan(stack="layers", pp=PipelinePlan(first=("tok_embeddings",), last=("norm", "output"), hidden=64,
                                                    vocab=256), loss=loss, inputs=("positions",))

if __name__ == "__main__":
    r = unbroken.train(plan=PLAN, replicas=2, steps=4, microbatches=3, exact=True, progress=False, out=sys.argv[1],
                       parallel__group_size=2, parallel__pp=2, model__arch="llama", model__n_kv_head=2,
                       data__path=sys.argv[2], data__eos=3, coord__heartbeat_timeout=2.0,
                       coord__heartbeat_interval=0.1)
    print("ok" if r.ok else "failed")
'''


def test_a_user_s_plan_with_document_positions_reaches_every_pipeline_stage_on_the_oracle_s_trajectory(tmp_path):
    """unbroken.train(plan=...): the user's own plan for the Llama (its pipeline split and loss, and
    `inputs=("positions",)`, which the Llama's own plan leaves out) in 2 groups of 2 stages, on token files
    whose documents end at an eos: each rank reports the plan applied (its stage, its layer, the inputs),
    every stage's RoPE gets each token's position in its document (a microbatch's rows, as x is split), and
    every digest is the oracle's fed the same positions (the one-rank run's: PP is bitwise), not the one
    without them."""
    import os
    import subprocess
    import sys

    import numpy as np

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(10, 250, int(rng.integers(3, 40))), 3) for _ in range(600)]  # 3: eos
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "docs.bin")  # raw uint16 tokens
    script = tmp_path / "user_script.py"
    script.write_text(PLAN_SCRIPT)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "docs.bin")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]
    events = read_events(out)
    applied = sorted((e["replica"], e.get("rank", 0), e["stage"], e["stack"], e["inputs"], e["fsdp_units"],
                      e["tp_sharded"]) for e in events if e["event"] == "parallelized")
    assert applied == [(g, j, j, [str(j)], ["positions"], [], 0) for g in (0, 1) for j in (0, 1)], applied
    cfg = Config.from_json((out / "config.json").read_text())
    first = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed, microbatches=3).microbatch(0, 0)
    assert first.positions[:, 1:].eq(0).any()  # a document starts inside a row
    want, _ = oracle(cfg, digest=staged(2), positions=True)
    assert [digests(out)[s] for s in range(4)] == want
    plain, _ = oracle(cfg, digest=staged(2))
    assert plain[0] != want[0]
