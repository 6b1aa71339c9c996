"""Import rules, bad input at the CLI, the checkpoint interval, and the engine's speed."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

import unbroken.sim
from unbroken.sim import cli
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import STRATEGIES
from unbroken.sim.strategies.restart import young_daly

SIM = Path(unbroken.sim.__file__).parent


@pytest.mark.timeout(20)
def test_sim_never_imports_runtime_or_torch():
    for f in SIM.rglob("*.py"):
        text = f.read_text()
        assert "unbroken.runtime" not in text and "import torch" not in text, f
    code = "import sys, unbroken.sim.cli, unbroken.sim.calibrate, unbroken.sim.plots; " \
           "assert 'torch' not in sys.modules and not any(m.startswith('unbroken.runtime') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)


def _run(argv: list[str]) -> int:
    return cli.main(["sim", *argv])


@pytest.mark.timeout(20)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(Path("scenarios/recover_512.toml").read_text().replace("dp = 64", "dp = 64\nbogus = 1"))
    for argv, words in [([str(tmp_path / "missing.toml")], "not found"),
                        ([str(bad)], "unknown key 'bogus'"),
                        (["scenarios/recover_512.toml", "--strategy", "nope"], "unknown strategy 'nope'")]:
        assert _run([*argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err


@pytest.mark.timeout(60)
def test_cli_writes_logs_summary_and_plots(tmp_path):
    assert _run(["scenarios/resihp_256_failstop.toml", "--out", str(tmp_path), "--seed", "1"]) == 0
    for name in STRATEGIES:
        assert (tmp_path / name / "events.jsonl").stat().st_size > 0
    for png in ("tokens.png", "throughput.png", "lost.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert '"log_sha256"' in (tmp_path / "summary.json").read_text()


def test_young_daly():
    assert young_daly(10.0, math.inf) == math.inf
    d, m = 1.0, 1e6  # d << M: Young's sqrt(2 d M) dominates
    assert young_daly(d, m) == pytest.approx(math.sqrt(2 * d * m), rel=1e-3)
    assert young_daly(30.0, 3600.0) < math.sqrt(2 * 30.0 * 3600.0)


@pytest.mark.timeout(40)
def test_llama3_scale_is_event_driven():
    sc = load("scenarios/llama3_16k.toml")
    t = time.perf_counter()
    end = simulate(sc, "unbroken_live", seed=0).end
    assert time.perf_counter() - t < 15  # 54 days, 16,384 GPUs, ~700k steps: never looped per step
    assert end["steps_committed"] > 500_000 and end["steps_batch_differs"] == 0
