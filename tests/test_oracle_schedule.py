"""The optimizer step every pre-training run has, against an oracle outside unbroken: a plain PyTorch loop
written here (AdamW with no decay on norms, biases and embeddings, a linear warmup then a cosine decay
written out below, clipping by torch's own clip_grad_norm_, float64 accumulation) equals the `--exact`
run bit for bit: failure-free, through a kill (in-step recovery) and through a whole-job crash restored
from memory. The lr of every step record equals the schedule's; a negative control shows clipping moves
the trajectory (so the oracle's equality is not blind to it)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import unbroken
from tests.oracle import adamw
from unbroken.config import Config
from unbroken.events import read_events
from unbroken.model.data import DataSource, mix
from unbroken.model.gpt import GPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS, WARMUP, MIN_RATIO, MAX_NORM = 6, 2, 0.1, 0.05
RUN = ["--replicas", "2", "--steps", str(STEPS), "--microbatches", "4", "--exact", "--run.progress=false",
       "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--optim.schedule=cosine",
       f"--optim.warmup_steps={WARMUP}", f"--optim.min_lr_ratio={MIN_RATIO}"]
CLIP = [f"--optim.max_grad_norm={MAX_NORM}"]


def lr_of(step: int, peak: float, steps: int = STEPS) -> float:
    """Linear warmup over WARMUP steps from peak / WARMUP, then cosine to MIN_RATIO x peak at the last step."""
    if step < WARMUP:
        return peak * ((step + 1) / WARMUP)
    p = (step - WARMUP) / max(1, steps - WARMUP - 1)
    return peak * (MIN_RATIO + (1 - MIN_RATIO) * (1 + math.cos(math.pi * p)) / 2)


def oracle(cfg: Config, clip: bool) -> tuple[list[str], list[float]]:
    """Parameter digests (XXH3-128 of the float32 parameters in order, as the step record's) and the
    gradient norms before clipping, after each step."""
    import xxhash

    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    data = DataSource(cfg.data, cfg.model.block_size, cfg.run.seed)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    opt = adamw(model, params, cfg.optim)
    model.train()
    digests, norms = [], []
    for step in range(cfg.run.steps):
        total = data.step_tokens(step, cfg.run.microbatches)
        acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for i in range(cfg.run.microbatches):
            mb = data.microbatch(step, i)
            torch.manual_seed(mix(cfg.run.seed, step, i))
            (model(mb.x, mb.y) * (mb.tokens / total)).backward()
            for a, p in zip(acc, params):
                a += p.grad
                p.grad = None
        for a, p in zip(acc, params):
            p.grad = a.to(torch.float32)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)))
        for group in opt.param_groups:
            group["lr"] = lr_of(step, cfg.optim.lr, cfg.run.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        h = xxhash.xxh3_128()
        for p in params:
            h.update(p.detach().contiguous().numpy().tobytes())
        digests.append(h.hexdigest())
    return digests, norms


def records(out: Path) -> dict[int, dict]:
    """The last step record of each step (a step redone after a whole-job restart has one per generation)."""
    return {e["step"]: e for e in read_events(out) if e["event"] == "step"}


@pytest.mark.parametrize("faults, extra", [
    ("", []),
    ("kill:replica=1,step=3,phase=allreduce", []),
    # group 0 sleeps through its step-4 compute (wall time only), so the crash lands inside step 4
    ("crash-all:step=4; slow:replica=0,from=4,to=5,factor=20,how=sleep",
     ["--run.recovery=restart-memory", "--snapshot.enabled=true"]),
], ids=["failure-free", "kill", "crash-all-restart-memory"])
def test_schedule_clipping_and_groups_match_a_plain_loop_bit_for_bit(tmp_path, faults, extra):
    out = tmp_path / "run"
    r = unbroken("train", *RUN, *CLIP, *extra, "--faults", faults, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    if faults.startswith("kill"):
        assert [e["replica"] for e in events if e["event"] == "member_dead"] == [1]
        assert any(e["event"] == "recovery" and e["step"] == 3 for e in events), "the kill cost no step"
    if faults.startswith("crash-all"):
        (crash,) = [e for e in events if e["event"] == "fault" and e.get("kind") == "crash-all"]
        assert any(e["event"] == "restart" for e in events), "no whole-job restart after the crash"
        loads = [e for e in events if e["event"] == "restored" and e["source"] == "memory"]
        assert loads and all(0 <= e["step"] < 4 for e in loads), f"not restored from memory: {loads}"
    cfg = Config.from_json((out / "config.json").read_text())
    want, norms = oracle(cfg, clip=True)
    got = records(out)
    assert [got[s]["param_digest"] for s in range(STEPS)] == want
    assert [got[s]["lr"] for s in range(STEPS)] == [lr_of(s, cfg.optim.lr) for s in range(STEPS)]
    assert [got[s]["grad_norm"] for s in range(STEPS)] == norms
    assert any(n > MAX_NORM for n in norms), f"no step was clipped (norms {norms}): the test shows nothing"


def test_clipping_moves_the_trajectory(tmp_path):
    """Negative control: the same run without clipping differs (`compare` exits 1), and its records carry
    no gradient norm."""
    on, off = tmp_path / "on", tmp_path / "off"
    for out, extra in ((on, CLIP), (off, [])):
        r = unbroken("train", *RUN, *extra, "--out", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
    r = unbroken("compare", str(on), str(off))
    assert r.returncode == 1, r.stdout[-2000:]
    assert all(e["grad_norm"] is None for e in records(off).values())


def test_a_resumed_run_keeps_the_schedule_and_the_oracle(tmp_path):
    """The coordinator SIGKILLed after 5 committed steps ends the launcher; `unbroken resume` restores the
    newest snapshot in a new generation, and every step of the whole run, before and after, steps at its
    schedule's lr and ends bitwise on the plain loop."""
    import os
    import signal
    import subprocess
    import sys
    import time

    steps_total = 40
    out = tmp_path / "cut"
    args = [a if a != str(STEPS) else str(steps_total) for a in RUN]
    cmd = [sys.executable, "-m", "unbroken.cli", "train", *args, *CLIP, "--snapshot.enabled=true", "--out", str(out)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log = out / "events.jsonl"
        if log.exists() and log.read_text().count('"event": "step"') + log.read_text().count('"event":"step"') >= 5:
            break
        time.sleep(0.05)
    os.kill(int((out / "logs" / "coordinator.pid").read_text()), signal.SIGKILL)
    launcher.communicate(timeout=120)
    assert launcher.returncode != 0, "the run finished before its coordinator was killed"
    first = read_events(out)
    assert max(e["step"] for e in first if e["event"] == "step") < steps_total - 1, "nothing left to resume"
    r = unbroken("resume", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert [e.get("resumed") for e in events if e["event"] == "restart"] == [True]
    assert {e["source"] for e in events if e["event"] == "restored"} == {"memory"}
    cfg = Config.from_json((out / "config.json").read_text())
    want, norms = oracle(cfg, clip=True)
    got = records(out)
    assert [got[s]["param_digest"] for s in range(steps_total)] == want
    assert [got[s]["lr"] for s in range(steps_total)] == [lr_of(s, cfg.optim.lr, steps_total) for s in range(steps_total)]
