"""A Hugging Face transformers `LlamaForCausalLM`, built from its config, through the Python API
(`unbroken.train(model=...)`) in 2 groups of 2 ranks, `--exact`, with the adapter's plan (model/hf.py):
FSDP2 one unit per decoder layer plus the root, TP from the config's base_model_tp_plan, PP by decoder
layers. Rank 1 of group 1 is killed in step 2, torchrun restarts the group and it rejoins healed rank by
rank; every digest is the layout's failure-free trajectory: the oracle's (tests/runtime/parallel/test_llama_groups.py's
plain loop, on the adapter) for FSDP2 and PP, a failure-free run's for TP (the suite runs PP: LAYOUTS).
In one process: the adapter's forward is Hugging Face's own bit for bit, its stages compose to it, its
TP plan is the config's, and FSDP2 makes one unit per decoder layer plus the root."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.trainer.test_groups import digests
from tests.runtime.parallel.test_llama_groups import oracle, sharded, staged
from unbroken.config import Config
from unbroken.events import read_events, steps

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

pytestmark = [pytest.mark.timeout(240)]

STEPS = 16
# Each worker of a user's script imports transformers: a group took 24-34 s to start on the shared 2-core host
# and its restart 13-19 s, so group 0 sleeps 3 s after each compute of steps 2-13 (a pipeline computes a
# step as one span: ~36 s of wall clock, no CPU) for the restarted
# group to rejoin with steps left
HOLD = "slow:replica=0,from=2,to=14,for=3"
# ~90 s each on 2 cores: the suite (at its 20-minute limit) runs the pipeline, the layout that needed the
# GPT's module names before plans; UNBROKEN_HF_LAYOUTS=fsdp,tp,pp runs the others too
LAYOUTS = os.environ.get("UNBROKEN_HF_LAYOUTS", "pp").split(",")
SCRIPT = '''
"""A user's script: a transformers LlamaForCausalLM from its config, trained by unbroken."""
import sys
import unbroken
from transformers import LlamaConfig
from unbroken.model.hf import causal_lm


def model(cfg):
    m = cfg.model
    return causal_lm(LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=2 * m.n_embd,
                                 num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=2,
                                 max_position_embeddings=m.block_size, tie_word_embeddings=False))


if __name__ == "__main__":
    layout = dict(a.split("=") for a in sys.argv[3].split(",")) if sys.argv[3] else {}
    r = unbroken.train(model=model, replicas=2, steps=int(sys.argv[2]), microbatches=3, exact=True, progress=False,
                       out=sys.argv[1], parallel__group_size=2, coord__heartbeat_timeout=2.0,
                       coord__heartbeat_interval=0.1, coord__progress_timeout=120,
                       **{f"parallel__{k}": int(v) for k, v in layout.items()},
                       **({"run__restarts": 1, "faults": sys.argv[4]} if len(sys.argv) > 4 else {}))
    print("ok" if r.ok else "failed")
'''


def build(cfg: Config) -> torch.nn.Module:
    """The script's model, in this process (the oracle's)."""
    namespace: dict = {}
    exec(SCRIPT.split("if __name__")[0], namespace)
    return namespace["model"](cfg)


def run(tmp: Path, name: str, layout: str, faults: str | None = None) -> Path:
    script = tmp / "user_script.py"
    script.write_text(SCRIPT)
    out = tmp / name
    args = [sys.executable, str(script), str(out), str(STEPS), layout, *([faults] if faults else [])]
    r = subprocess.run(args, cwd=tmp, capture_output=True, text=True, timeout=220,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]
    return out


def small() -> Config:
    from unbroken.config import build as config
    return config({}, {"model.n_layer": "2", "run.steps": "1"})


def test_the_adapter_is_hugging_face_s_forward_and_its_stages_compose_to_it_bit_for_bit():
    from unbroken.runtime.parallel.pipeline import split

    cfg = small()
    torch.manual_seed(0)
    model = build(cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa")
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), hf(x).logits)
    first, last = (split(copy.deepcopy(model), j, 2)[0] for j in range(2))
    assert torch.equal(last(first(x)), model(x))
    plan = model.parallel_plan()
    assert {k: type(v).__name__ for k, v in plan.tp.layer.items()} == {
        "self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
        "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel", "mlp.down_proj": "RowwiseParallel"}


def test_fsdp2_shards_each_decoder_layer_then_the_root():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.runtime.parallel.parallelize import _fully_shard
    from unbroken.runtime.parallel.precision import policy

    model = build(small())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        sharded_model = _fully_shard(model, model.parallel_plan(), init_device_mesh("cpu", (2,)), policy("off", True))
        assert [n for n, m in sharded_model.named_modules() if isinstance(m, FSDPModule)] == ["", "layers.0", "layers.1"]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_killed_and_its_group_restarted_stays_on_the_layout_s_trajectory(tmp_path, layout):
    spec = {"fsdp": "", "tp": "tp=2", "pp": "pp=2"}[layout]
    out = run(tmp_path, "run", spec, f"kill:replica=1,rank=1,step=2,phase=compute;{HOLD}")
    events = read_events(out)
    fired = [e for e in events if e["event"] == "fault" and e.get("kind") == "kill"]
    assert [(e["replica"], e["rank"], e["step"]) for e in fired] == [(1, 1, 2)]
    heals = [e for e in events if e["event"] == "heal"]
    assert sorted((e["side"], e["rank"]) for e in heals) == [(s, j) for s in ("donor", "joiner") for j in range(2)]
    record = steps(events)
    assert record[2]["members"] == [0] and record[heals[0]["step"] + 1]["members"] == record[STEPS - 1]["members"] \
        == [0, 1]
    cfg = Config.from_json((out / "config.json").read_text())
    if layout == "tp":
        assert digests(run(tmp_path, "reference", spec)) == digests(out)
        return
    want, _ = oracle(cfg, shares=2 if layout == "fsdp" else 1, digest=sharded(2) if layout == "fsdp" else staged(2),
                     build=build)
    assert [digests(out)[s] for s in range(STEPS)] == want
