"""Bad input through the real CLI (`python -m unbroken.cli`, a fresh process each): exit code 2, exactly
one stderr line `unbroken: error: ...` naming the offending token, no traceback, and nothing started —
no run directory, no events.jsonl. On hand-made logs, too, the line between bad input (a log that is
corrupt or holds no run: exit 2) and what audit and compare find in a readable log (exit 1)."""
from __future__ import annotations

import json
from pathlib import Path

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
    # the Llama's plan: a TP degree that does not divide the KV heads, or the SwiGLU width (the model's
    # plan, checked on the meta device), more stages than layers
    (["--model.arch=llama", "--model.n_kv_head=2", "--parallel.group_size=4", "--parallel.tp=4"], "model.n_kv_head=2"),
    (["--model.arch=llama", "--model.intermediate_size=5", "--parallel.group_size=2", "--parallel.tp=2"],
     "model.intermediate_size=5"),
    (["--model.arch=llama", "--parallel.group_size=3", "--parallel.pp=3"], "parallel.pp=3"),
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
    assert "is not a directory" in line or "must be in (0, " in line
    assert not out.exists()


@pytest.mark.parametrize("where", ["under a regular file", "/proc/x", "/proc/x/deeper"])
def test_unwritable_out_is_one_line(tmp_path, where):
    """--out that cannot be created, whatever the reason: under a regular file (caught by looking), or
    under /proc, which os.access calls writable for root and mkdir refuses (caught only by trying); one
    line naming the path, exit 2, nothing written (the probe removes what it made)."""
    (tmp_path / "FILE").write_text("not a directory")
    out = tmp_path / "FILE" / "run" if where == "under a regular file" else Path(where)
    before = sorted(tmp_path.iterdir())
    r = unbroken("train", *SMALL, "--out", str(out), timeout=25)
    line = assert_one_line_error(r, f"launch.out={str(out)!r}: cannot be created")
    assert "Traceback" not in r.stderr and not r.stdout, r.stdout
    assert not out.exists() and sorted(tmp_path.iterdir()) == before


def test_out_probe_leaves_nothing_when_a_later_check_fails(tmp_path):
    """A creatable --out is tried by making it; a later check's failure (here a bad checkpoint.dir) must
    still find nothing written: the probe removed the directories it made."""
    (tmp_path / "FILE").write_text("not a directory")
    out = tmp_path / "a" / "b" / "run"
    r = unbroken("train", *SMALL, "--checkpoint.every=2", f"--checkpoint.dir={tmp_path / 'FILE' / 'ckpt'}",
                 "--out", str(out), timeout=25)
    assert_one_line_error(r, "checkpoint.dir=")
    assert not (tmp_path / "a").exists()


def write_run(run: Path, steps: int = 4, only: set[int] | None = None) -> Path:
    """A hand-made finished run of one replica and one microbatch a step that the audit passes (with
    `only`: just those steps recorded), and its config.json."""
    run.mkdir(parents=True)
    recs = [{"event": "run_start", "t": 0.0, "schema": 1, "replicas": 1, "steps": steps, "microbatches": 1,
             "exact": True, "seed": 0, "faults": "", "run_id": "run-x", "group_size": 1},
            {"event": "epoch", "t": 0.0, "epoch": 0, "members": [0]}]
    for s in sorted(only) if only is not None else range(steps):
        mb = {"step": s, "replica": 0, "epoch": 0}
        recs += [{"event": "compute", "t": s + 0.1, **mb, "microbatch": 0, "seconds": 0.1, "tokens": 8},
                 {"event": "reduce", "t": s + 0.2, **mb, "seconds": 0.01, "ok": True, "wait": 0.0},
                 {"event": "applied", "t": s + 0.3, "step": s, "replica": 0, "state_digest": "ab"},
                 {"event": "step", "t": s + 0.5, "step": s, "loss": 5.0 - s / 10, "microbatches": 1, "replicas": 1,
                  "members": [0], "epoch": 0, "tokens": 8, "param_digest": f"d{s}", "owners": {"0": [0]}}]
    recs.append({"event": "run_end", "t": steps + 1.0, "ok": True, "steps_committed": steps, "error": None})
    (run / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.json").write_text(json.dumps({"run": {"replicas": 1, "steps": steps, "microbatches": 1,
                                                         "exact": True, "seed": 0, "faults": ""}}))
    return run


def edit_line(run: Path, n: int, edit) -> None:
    """Replace line `n` (1-based) of the run's log by `edit(line)`."""
    ls = (run / "events.jsonl").read_text().splitlines(keepends=True)
    ls[n - 1] = edit(ls[n - 1])
    (run / "events.jsonl").write_text("".join(ls))


@pytest.mark.parametrize("command", ["report", "status"])
def test_report_and_status_on_a_corrupt_middle_line(tmp_path, command):
    run = write_run(tmp_path / "run")
    assert unbroken(command, str(run), timeout=25).returncode == 0  # the log as written reads fine
    (run / "report.png").unlink(missing_ok=True)
    edit_line(run, 4, lambda line: "garbage\n")
    r = unbroken(command, str(run), timeout=25)
    assert_one_line_error(r, f"{run / 'events.jsonl'}: line 4 is not an event record")
    assert "Traceback" not in r.stderr and not (run / "report.png").exists()


def test_compare_with_a_step_record_lacking_loss(tmp_path):
    ref, run = write_run(tmp_path / "ref"), write_run(tmp_path / "run")
    n = next(n for n, line in enumerate((run / "events.jsonl").read_text().splitlines(), 1)
             if '"event": "step", "t": 2.5' in line)
    edit_line(run, n, lambda line: json.dumps({k: v for k, v in json.loads(line).items() if k != "loss"}) + "\n")
    for a, b in ((ref, run), (run, ref)):
        r = unbroken("compare", str(a), str(b), timeout=25)
        line = assert_one_line_error(r, f"{run / 'events.jsonl'}: the record of step 2 lacks loss")
        assert "Traceback" not in r.stderr and not r.stdout, line  # no table, no half a report


def test_audit_names_the_missing_steps_of_a_run_holding_only_step_7(tmp_path):
    """A finding in a readable log: exit 1, not bad input."""
    run = write_run(tmp_path / "run", steps=12, only={7})
    r = unbroken("audit", str(run), timeout=25)
    assert r.returncode == 1 and not r.stderr, (r.returncode, r.stdout, r.stderr)
    assert sum("steps without a record: 0-6, 8-11 (of 0..11)" in line for line in r.stdout.splitlines()) == 1, r.stdout


def test_compare_counts_the_steps_run_start_configured(tmp_path):
    """12 steps configured, only step 7 recorded (and identical): 1 of 12, not of 8 (the highest step
    recorded, plus one), and the run counts as incomplete."""
    a, b = (write_run(tmp_path / name, steps=12, only={7}) for name in ("a", "b"))
    r = unbroken("compare", str(a), str(b), timeout=25)
    assert r.returncode == 1 and not r.stderr, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines()[-1] == "identical: 1/12 steps (a run is incomplete)", r.stdout
    assert "incomplete: run B: 11 of 12 steps have no record (first: 0)" in r.stdout.splitlines()


def test_a_run_written_before_faults_and_launch_moved_out_of_run_still_reads(tmp_path):
    """A run directory whose config.json holds faults, out, progress, launcher, restarts,
    max_job_restarts and pin_cores under [run] (and reform_seconds under [parallel]): audit and report
    read it, audit checks its fault spec against run_start, and resume builds its config from it."""
    from unbroken.runtime.launcher.resume import read_run
    run = write_run(tmp_path / "run")
    old = {"run": {"replicas": 1, "steps": 4, "microbatches": 1, "seed": 0, "exact": True, "threads": 1,
                   "faults": "", "quotas": "speed", "recovery": "live", "step_ahead": "auto", "out": str(run),
                   "progress": False, "launcher": "direct", "restarts": 0, "max_job_restarts": 5,
                   "pin_cores": False},
           "parallel": {"reform_seconds": 0.5}}
    (run / "config.json").write_text(json.dumps(old))
    for command in ("audit", "report"):
        r = unbroken(command, str(run), timeout=25)
        assert r.returncode == 0 and not r.stderr, (command, r.stdout, r.stderr)
    old["run"]["faults"] = "kill:replica=0,step=1"
    (run / "config.json").write_text(json.dumps(old))
    r = unbroken("audit", str(run), timeout=25)
    assert r.returncode == 1 and "config.json is not this run's: faults.spec = 'kill:replica=0,step=1'" in r.stdout
    old["run"]["faults"] = ""
    (run / "config.json").write_text(json.dumps(old))
    edit_line(run, len((run / "events.jsonl").read_text().splitlines()), lambda line: "")  # no run_end: ended early
    cfg, point = read_run(run, {"run.progress": "true"})
    assert (cfg.launch.out, cfg.launch.progress, cfg.launch.launcher, cfg.launch.max_job_restarts) == \
        (str(run), True, "direct", 5)
    assert cfg.faults.spec == "" and cfg.hardware.reform_seconds == 0.5 and point.last_step == 3
