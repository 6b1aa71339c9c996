"""A model trained through unbroken.model.hf.causal_lm, in and out of Hugging Face's layout: a user's script
starts a transformers LlamaForCausalLM of its own config from a directory on disk (--model.init_from: the
adapter's names, `model.` stripped), trains it, and `unbroken export` writes it back under transformers'
names with the config.json init_from named; transformers loads it and its logits are the adapter's forward
on the checkpoint's parameters."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import unbroken
from unbroken.events import read_events, steps

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = '''
import sys
import unbroken
from transformers import AutoConfig
from unbroken.model.hf import causal_lm

if __name__ == "__main__":
    start = sys.argv[2]
    r = unbroken.train(model=lambda cfg: causal_lm(AutoConfig.from_pretrained(start)), replicas=2, steps=3,
                       microbatches=4, exact=True, progress=False, out=sys.argv[1], model__init_from=start,
                       model__block_size=32, data__seq_len="32", data__max_files=20, checkpoint__every=100,
                       coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1, coord__progress_timeout=120)
    print("ok" if r.ok else "failed")
'''


def test_a_causal_lm_run_starts_from_and_exports_to_a_hugging_face_directory(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from unbroken.model.hf import causal_lm
    from unbroken.runtime.persist.export import read_params

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(123)  # not the run's seed: its own initialisation would be other weights
    LlamaForCausalLM(config).save_pretrained(tmp_path / "start")
    (tmp_path / "user_script.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "user_script.py", str(tmp_path / "run"), str(tmp_path / "start")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=220,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]
    assert sorted(steps(read_events(tmp_path / "run"))) == [0, 1, 2]
    e = unbroken("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    assert e.returncode == 0, e.stderr
    step, params = read_params(tmp_path / "run" / "checkpoints", None)
    assert step == 2 and "layers.0.self_attn.q_proj.weight" in params
    ours = causal_lm(config)
    ours.load_state_dict(params, strict=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="sdpa")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x).logits, atol=1e-5, rtol=0)
    start = LlamaForCausalLM.from_pretrained(tmp_path / "start")
    moved = max((p - params[n.removeprefix("model.")]).abs().max().item() for n, p in start.named_parameters())
    # three AdamW steps at lr 3e-3 move a weight by at most ~0.009: the run started from these weights
    assert 0 < moved < 0.012, moved
