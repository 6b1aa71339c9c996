"""Hugging Face weights out of a run and into another, through the CLI: `unbroken export RUN --hf DIR` writes
what transformers loads, its logits unbroken's own forward's on the checkpoint; `--model.init_from=DIR`
starts a run from those weights (its first step's loss is theirs on that step's microbatches) and that run
is bitwise its own failure-free run through a replica killed mid-reduction under --exact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import side_by_side, unbroken
from unbroken.config import Config
from unbroken.events import read_events, steps

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LLAMA = ["--model.arch=llama", "--model.n_layer=2", "--model.n_embd=32", "--model.n_head=4", "--model.n_kv_head=2",
         "--model.intermediate_size=64", "--model.block_size=32", "--data.seq_len=32", "--data.max_files=20"]
RUN = ["--replicas", "2", "--steps", "3", "--microbatches", "4", "--exact", "--launch.progress=false",
       "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=200", *LLAMA]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A 3-step Llama run checkpointed at step 0 and its last step, exported (the last step's checkpoint)."""
    root = tmp_path_factory.mktemp("hf")
    r = unbroken("train", *RUN, "--checkpoint.every=100", "--out", str(root / "source"))
    assert r.returncode == 0, r.stderr[-2000:]
    e = unbroken("export", str(root / "source"), "--hf", str(root / "hf"))
    assert e.returncode == 0, e.stderr[-2000:]
    assert "wrote step 2 of" in e.stdout, e.stdout
    return root / "source", root / "hf"


def test_export_loads_in_transformers_with_unbroken_logits(exported):
    from unbroken.model.llama import Llama
    from unbroken.runtime.persist.export import read_params

    run, hf = exported
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    cfg = Config.from_json((run / "config.json").read_text())
    step, params = read_params(run / "checkpoints", None)
    assert step == 2
    ours = Llama(cfg.model)
    ours.load_state_dict(params, strict=False)  # the rotary table is a buffer, not in the checkpoint
    assert all(torch.equal(p, params[n]) for n, p in ours.named_parameters())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert json.loads((hf / "config.json").read_text())["num_key_value_heads"] == 2
    bad = unbroken("export", str(run), "--hf", str(run.parent / "x"), "--step", "1")
    assert bad.returncode == 2 and bad.stderr.strip().endswith("(there are: 0, 2)"), bad.stderr


def test_a_run_started_from_exported_weights_is_exact_through_a_kill(exported, tmp_path):
    from unbroken.model.data import DataSource
    from unbroken.model.hfweights import load_into
    from unbroken.model.llama import Llama

    run, hf = exported
    init = [*RUN, f"--model.init_from={hf}", "--seed=7"]
    kill = "kill:replica=1,step=1,phase=allreduce"
    ref, faulty = side_by_side(lambda: unbroken("train", *init, "--out", str(tmp_path / "ref")),
                               lambda: unbroken("train", *init, "--faults", kill, "--out", str(tmp_path / "kill")))
    assert ref.returncode == 0 and faulty.returncode == 0, (ref.stderr[-1500:], faulty.stderr[-1500:])
    fired = [e for e in read_events(tmp_path / "kill") if e["event"] == "fault" and e.get("kind") == "kill"]
    assert [(e["replica"], e["step"]) for e in fired] == [(1, 1)]
    a, b = steps(read_events(tmp_path / "ref")), steps(read_events(tmp_path / "kill"))
    assert b[2]["members"] == [0]  # the kill had its effect: the last step ran on the survivor
    assert [a[s]["param_digest"] for s in range(3)] == [b[s]["param_digest"] for s in range(3)]
    # the run started from the exported weights: step 0's loss is theirs on step 0's microbatches
    cfg = Config.from_json((tmp_path / "ref" / "config.json").read_text())
    model = Llama(cfg.model)
    load_into(model, hf, cfg.model)
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed, microbatches=cfg.run.microbatches)
    total = data.step_tokens(0, cfg.run.microbatches)
    with torch.no_grad():
        loss = sum(model(mb.x, mb.y).double().item() * mb.tokens / total
                   for mb in (data.microbatch(0, i) for i in range(cfg.run.microbatches)))
    assert a[0]["loss"] == pytest.approx(loss, rel=1e-6)
    scratch = steps(read_events(run))[0]["loss"]  # the seed's initialisation gives another loss
    assert abs(scratch - a[0]["loss"]) > 1e-3
