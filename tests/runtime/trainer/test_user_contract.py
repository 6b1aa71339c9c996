"""The README's contract, as a user reads it: `data(cfg)` returns any object whose `microbatch(step, i)` has
the fields `x`, `y`, `tokens` and `sumsq` (nothing else: no `ignore_index`, no `positions`) and
`step_tokens(step, M)`; `model(cfg)` returns an `nn.Module`. The user's microbatches have 6 rows of 24
tokens, unlike the config's data.batch_size (4) and data.seq_len (64), which the user never sets.

In each layout of the README's table (one-rank replicas, FSDP2, TP, PP, PP x TP), each with a model through
another documented path (`model=` with the built-in GPT, with transformers' Qwen2, Llama and Mistral through
`causal_lm`, the GPT with `plan=`, and with a torchtitan-style `parallelize=`), through the Python API,
`--exact`: a failure-free run, and a run in which rank 1 of group 1 (its one rank in one-rank groups) is
SIGKILLed in step 2's compute (its group leaves, group 0 redoes its microbatches): every step's digest is
the failure-free run's. The event log shows the kill fired and took group 1 out. A layout the data cannot
serve (rows that FSDP2's shards do not divide) is refused before any process starts, in one line naming
what to change.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.trainer.test_groups import digests
from unbroken.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = '''
"""A user's script: a model through one documented path, and a data object of the four documented fields."""
import sys
from types import SimpleNamespace

import torch

import unbroken
from unbroken.config import ConfigError
from unbroken.model.gpt import GPT

ROWS, SEQ = int(sys.argv[4]), 24


class Tokens:
    """Random byte tokens, a pure function of (seed, step, i)."""
    def __init__(self, cfg):
        self.seed = cfg.run.seed

    def microbatch(self, step, i):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1009 + i)
        t = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
        return SimpleNamespace(x=t[:, :-1], y=t[:, 1:], tokens=ROWS * SEQ, sumsq=ROWS * SEQ * SEQ)

    def step_tokens(self, step, M):
        return M * ROWS * SEQ


def hf(name):
    import transformers
    from unbroken.model.hf import causal_lm

    def build(cfg):
        m = cfg.model
        config = getattr(transformers, f"{name}Config")(
            vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=2 * m.n_embd,
            num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=2,
            max_position_embeddings=m.block_size, tie_word_embeddings=False)
        return causal_lm(config)
    return build


def family(name):
    """The keywords of unbroken.train for one documented path: model=, with plan= or parallelize=, causal_lm."""
    if name == "gpt":
        return {"model": lambda cfg: GPT(cfg.model)}
    if name == "gpt-plan":
        from unbroken.config import ModelConfig
        return {"model": lambda cfg: GPT(cfg.model), "plan": GPT(ModelConfig()).parallel_plan()}
    if name == "gpt-parallelize":  # a torchtitan-style function: FSDP2 over the whole model
        from torch.distributed.fsdp import fully_shard
        return {"model": lambda cfg: GPT(cfg.model),
                "parallelize": lambda model, mesh, dims: fully_shard(model, mesh=mesh["dp_shard"],
                                                                     mp_policy=dims["mp_policy"])}
    return {"model": hf(name.removeprefix("hf-"))}


if __name__ == "__main__":
    layout = dict(a.split("=") for a in sys.argv[3].split(","))
    try:
        r = unbroken.train(**family(sys.argv[5]), data=Tokens, replicas=2, steps=int(sys.argv[2]), microbatches=4,
                           exact=True, progress=False, out=sys.argv[1], model__dropout=0.0,
                           coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1, coord__progress_timeout=120,
                           **{f"parallel__{k}": int(v) for k, v in layout.items()},
                           **({"faults": sys.argv[6]} if len(sys.argv) > 6 else {}))
    except ConfigError as e:  # the API's bad input: one line, as the CLI prints it
        sys.exit(f"unbroken: error: {e}")
    print("ok" if r.ok else "failed")
'''
STEPS = 5
# (layout, family): every layout of the README's table that a group runs, each through another documented
# path; transformers' families are built from their configs (Llama, Qwen2, Mistral)
CASES = {("one-rank", "gpt"): "group_size=1", ("fsdp", "gpt-parallelize"): "group_size=2",
         ("fsdp", "hf-Qwen2"): "group_size=2", ("tp", "gpt-plan"): "group_size=2,tp=2",
         ("pp", "hf-Llama"): "group_size=2,pp=2", ("pp x tp", "hf-Mistral"): "group_size=4,pp=2,tp=2"}


def kill(layout: str) -> str:
    """Rank 1 of group 1 killed in step 2's compute; in one-rank groups, group 1's one rank."""
    return f"kill:replica=1,{'' if layout == 'one-rank' else 'rank=1,'}step=2,phase=compute"


def run(tmp: Path, name: str, layout: str, family: str = "gpt", rows: int = 6, faults: str | None = None,
        ok: bool = True) -> subprocess.CompletedProcess:
    script = tmp / "user_script.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), str(tmp / name), str(STEPS), layout, str(rows), family,
            *([faults] if faults else [])]
    r = subprocess.run(args, cwd=tmp, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if ok:
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-3000:]
    return r


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0].replace(' ', '')}-{c[1]}")
def test_a_user_data_object_of_the_four_fields_trains_exact_through_a_kill(tmp_path, case):
    layout, family = case
    run(tmp_path, "reference", CASES[case], family)
    run(tmp_path, "killed", CASES[case], family, faults=kill(layout))
    events = read_events(tmp_path / "killed")
    fired = [e for e in events if e["event"] == "fault" and e["kind"] == "kill"]
    assert [(e["replica"], e.get("rank", 0), e["step"]) for e in fired] == [(1, 0 if layout == "one-rank" else 1, 2)], fired
    assert [e["replica"] for e in events if e["event"] == "member_dead"] == [1]
    late = [e for e in events if e["event"] == "step" and e["step"] > 2]
    assert late and all(set(e["owners"]) == {"0"} for e in late), late  # group 0 alone took the steps after
    want, got = digests(tmp_path / "reference"), digests(tmp_path / "killed")
    assert sorted(got) == list(range(STEPS)) and got == want
    print(f"user contract, layout {layout} ({CASES[case]}), family {family}, data of 6 x 24 tokens with only x, "
          f"y, tokens, sumsq: {STEPS} steps bitwise the failure-free run's through {kill(layout)}")


def test_rows_that_fsdp_shards_do_not_divide_are_refused_before_start(tmp_path):
    r = run(tmp_path, "odd", "group_size=2", rows=5, ok=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stdout[-1000:] + r.stderr[-2000:]
    assert "5 rows" in lines[0] and "parallel.group_size" in lines[0], lines
    assert not (tmp_path / "odd" / "events.jsonl").exists()
