"""Oracles outside unbroken's runtime, and a negative control for `compare`.

The fault tests compare a faulty run with unbroken's own failure-free run: a bug that hits both alike
(a microbatch dropped by the policy, a loss weight off, an optimizer step applied twice) would pass.
Here the failure-free `--exact` run, and a run that loses a replica, are held against a plain PyTorch
loop written in this file: one process, the same model, data and microbatches, float64 accumulation,
and none of unbroken's runtime (no accumulator, collective, trainer or policy code). Its parameters
after every step must equal the run's `param_digest`, bit for bit. The same again through the Python
API with a model and data defined in this file.

Negative control: `compare` must be able to say "differs": runs with another seed, or with the
learning rate moved by one part in a million, make it exit 1.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import xxhash

from tests.conftest import unbroken
from tests.oracle import adamw
from unbroken.config import Config
from unbroken.events import read_events
from unbroken.model.data import DataSource, mix
from unbroken.model.gpt import GPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN = ["--replicas", "2", "--steps", "4", "--microbatches", "4", "--exact", "--run.progress=false",
       "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1"]


def digest(params: list[torch.nn.Parameter]) -> str:
    """XXH3-128 of the float32 parameters concatenated in named_parameters order (the step record's),
    computed here with the xxhash package itself."""
    h = xxhash.xxh3_128()
    for p in params:
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def plain_loop(model: torch.nn.Module, data, opt_of, seed: int, steps: int, m: int) -> list[str]:
    """The textbook step, in one process: for each microbatch (seed, step, i) its seeded forward and
    backward, loss weighted by its share of the step's tokens, gradients summed in float64 in order
    0..M-1, rounded to float32 once, one optimizer step. Returns the parameter digest after each step."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    opt = opt_of(params)
    model.train()
    out = []
    for step in range(steps):
        total = data.step_tokens(step, m)
        acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for i in range(m):
            mb = data.microbatch(step, i)
            torch.manual_seed(mix(seed, step, i))  # dropout: a function of (seed, step, i)
            loss = model(mb.x, mb.y) * (mb.tokens / total)
            loss.backward()
            for a, p in zip(acc, params):
                a += p.grad
                p.grad = None
        for a, p in zip(acc, params):
            p.grad = a.to(torch.float32)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(digest(params))
    return out


def recorded(run: Path) -> list[str]:
    steps = {e["step"]: e["param_digest"] for e in read_events(run) if e["event"] == "step"}
    return [steps[s] for s in sorted(steps)]


@pytest.fixture(scope="module")
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as every replica runs (run.threads=1): kernels sum in the same order
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("faults", ["", "kill:replica=1,step=2,phase=allreduce"])
def test_plain_pytorch_loop_matches_the_exact_run_bit_for_bit(tmp_path, threads, faults):
    out = tmp_path / "run"
    r = unbroken("train", *RUN, "--faults", faults, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    if faults:
        assert [e["replica"] for e in read_events(out) if e["event"] == "member_dead"] == [1]
    cfg = Config.from_json((out / "config.json").read_text())
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed)
    o = cfg.optim
    want = plain_loop(model, data, lambda ps: adamw(model, ps, o), cfg.run.seed, cfg.run.steps,
                      cfg.run.microbatches)
    assert recorded(out) == want


SCRIPT = textwrap.dedent('''
    """A user's script: a model and data unbroken has never seen (defined here, not in the package)."""
    import sys
    from types import SimpleNamespace
    import torch, torch.nn as nn, torch.nn.functional as F
    import unbroken

    class Data:  # microbatch (step, i): a pure function of (step, i); 6 or 10 sequences
        def microbatch(self, step, i):
            g = torch.Generator().manual_seed(7919 * step + i)
            n = 6 + 4 * (i % 2)
            x = torch.randint(0, 32, (n, 5), generator=g)
            return SimpleNamespace(x=x, y=(x.sum(1) * 3) % 32, tokens=n, sumsq=n * 25)
        def step_tokens(self, step, m):
            return sum(6 + 4 * (i % 2) for i in range(m))

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.drop, self.out = nn.Embedding(32, 24), nn.Dropout(0.2), nn.Linear(24, 32)
        def forward(self, x, y):
            return F.cross_entropy(self.out(self.drop(torch.tanh(self.emb(x).mean(1)))), y)

    def opt(params, cfg=None):
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)

    if __name__ == "__main__":
        r = unbroken.train(model=lambda cfg: Bag(), data=lambda cfg: Data(), optimizer=opt, replicas=3,
                           steps=5, microbatches=6, exact=True, seed=3, progress=False, out=sys.argv[1],
                           faults=sys.argv[2], coord__heartbeat_timeout=2.0, coord__heartbeat_interval=0.1)
        print("ok" if r.ok else "failed")
''')


def test_python_api_with_a_model_of_the_test_matches_a_plain_loop(tmp_path, threads):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(script), str(out), "kill:replica=2,step=1,phase=compute"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    assert [e["replica"] for e in read_events(out) if e["event"] == "member_dead"] == [2]
    ns: dict = {}
    exec(compile(SCRIPT, str(script), "exec"), ns)  # the same classes, not run as __main__
    torch.manual_seed(3)
    want = plain_loop(ns["Bag"](), ns["Data"](), ns["opt"], seed=3, steps=5, m=6)
    assert recorded(out) == want


@pytest.fixture(scope="module")
def seed0(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed0") / "run"
    r = unbroken("train", *RUN, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("change", [["--seed", "1"], ["--optim.lr=0.003000003"]])
def test_compare_reports_a_different_run(tmp_path, seed0, change):
    out = tmp_path / "run"
    r = unbroken("train", *RUN, *change, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    c = unbroken("compare", str(seed0), str(out))
    assert c.returncode == 1, c.stdout[-2000:]
    assert c.stdout.strip().splitlines()[-1] == "identical: 0/4 steps", c.stdout[-2000:]
