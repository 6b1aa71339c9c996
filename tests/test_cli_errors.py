"""Bad input through the real CLI (`python -m unbroken.cli`, a fresh process each): exit code 2, exactly
one stderr line `unbroken: error: ...` naming the offending token, no traceback, and nothing started —
no run directory, no events.jsonl."""
from __future__ import annotations

import pytest

from tests.conftest import unbroken

pytestmark = pytest.mark.timeout(30)

SMALL = ["--replicas", "2", "--steps", "4", "--run.progress=false"]


def assert_one_line_error(r, token: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("unbroken: error: ") and token in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, token", [
    (["--faults", "kill:replica1"], "'replica1'"),  # malformed spec
    (["--faults", "kill:replica=1,step=2,phase=backward"], "'backward'"),  # unknown phase
    (["--faults", "kill:replica=2,step=1"], "replica=2"),  # replica id out of range (2 replicas)
    (["--faults", "explode:replica=1,step=1"], "'explode'"),  # unknown fault kind
    (["--steps", "0"], "run.steps=0"),
    (["--replicas", "0"], "run.replicas=0"),
    (["--model.layers=3"], "model.layers"),  # unknown key in a known section
    (["--optimizer.lr=0.1"], "'optimizer'"),  # unknown section
    (["--model.n_layer=two"], "'two'"),  # bad value type
    (["--steps", "many"], "'many'"),  # bad value type caught by argparse
    (["--config", "/no/such/unbroken.toml"], "/no/such/unbroken.toml"),  # missing config file
    (["--data", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
    (["--data.seq_len=65"], "data.seq_len='65'"),  # longer than model.block_size: caught before start
    (["--epochs=3"], "'--epochs=3'"),
])
def test_train_rejects_bad_input_before_starting(tmp_path, args, token):
    out = tmp_path / "run"
    r = unbroken("train", *SMALL, *args, "--out", str(out), timeout=25)
    assert_one_line_error(r, token)
    assert "Traceback" not in r.stderr
    assert not out.exists() and not (out / "events.jsonl").exists()


def test_bad_toml_is_one_line(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[run]\nsteps = \n")
    out = tmp_path / "run"
    assert_one_line_error(unbroken("train", "--config", str(cfg), "--out", str(out), timeout=25), "bad.toml")
    assert not out.exists()


def test_compare_and_audit_on_a_non_run_directory(tmp_path):
    (tmp_path / "a").mkdir()
    assert_one_line_error(unbroken("compare", str(tmp_path / "a"), str(tmp_path / "b"), timeout=25), "/a'")
    assert_one_line_error(unbroken("audit", str(tmp_path), timeout=25), "is not a run directory")


def test_usage_errors_are_one_line():
    assert_one_line_error(unbroken(timeout=25), "command")
    assert_one_line_error(unbroken("compare", "only-one", timeout=25), "b")


@pytest.mark.parametrize("args, token", [
    (["--coord.collective_timeout=-1"], "coord.collective_timeout=-1.0"),
    (["--coord.run_timeout=0"], "coord.run_timeout=0.0"),
    (["--snapshot.enabled=true", "--snapshot.shm_dir=FILE/shm"], "snapshot.shm_dir="),
    (["--checkpoint.every=2", "--checkpoint.dir=FILE/ckpt"], "checkpoint.dir="),
])
def test_bad_timeouts_and_unwritable_directories(tmp_path, args, token):
    """A path under a regular file can be created by nobody, root included (os.access would say yes
    to root for a read-only directory)."""
    (tmp_path / "FILE").write_text("not a directory")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    out = tmp_path / "run"
    r = unbroken("train", *SMALL, *args, "--out", str(out), timeout=25)
    line = assert_one_line_error(r, token)
    assert "is not a directory" in line or "must be > 0" in line
    assert not out.exists()


def test_unwritable_out_is_one_line(tmp_path):
    (tmp_path / "FILE").write_text("not a directory")
    out = tmp_path / "FILE" / "run"
    line = assert_one_line_error(unbroken("train", *SMALL, "--out", str(out), timeout=25), "run.out=")
    assert str(out) in line and "Traceback" not in line
