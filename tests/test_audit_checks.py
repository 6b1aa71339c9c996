"""`unbroken audit` and `unbroken compare` catch what they claim: each hand-broken copy of a real run's
log makes them exit non-zero with a line naming the problem; only the untouched run passes.

One real run (2 replicas, 4 steps, 4 microbatches, --exact) is made once; each test breaks a copy of it
the way a lost record, a double count or a foreign file would, and drives the real CLI.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import unbroken

pytestmark = pytest.mark.timeout(120)

RUN = ["--replicas", "2", "--steps", "4", "--microbatches", "4", "--exact", "--run.progress=false"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "run"
    r = unbroken("train", *RUN, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def copy(clean: Path, tmp_path: Path, name: str = "broken") -> Path:
    dst = tmp_path / name
    shutil.copytree(clean, dst)
    return dst


def lines(run: Path) -> list[str]:
    return (run / "events.jsonl").read_text().splitlines(keepends=True)


def rewrite(run: Path, edit) -> None:
    """Apply `edit(record) -> record | None` (None drops it) to every record of the log."""
    out = []
    for line in lines(run):
        r = edit(json.loads(line))
        if r is not None:
            out.append(json.dumps(r) + "\n")
    (run / "events.jsonl").write_text("".join(out))


def assert_fails(r, token: str, code: int = 1) -> None:
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    if code == 2:
        err = r.stderr.splitlines()
        assert len(err) == 1 and err[0].startswith("unbroken: error: ") and token in err[0], r.stderr
    else:
        assert any(token in line for line in r.stdout.splitlines()), r.stdout[-2000:]


def test_the_untouched_run_passes(clean, tmp_path):
    r = unbroken("audit", str(clean))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "audit: 0 problems", r.stdout + r.stderr
    r = unbroken("compare", str(clean), str(copy(clean, tmp_path)))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "identical: 4/4 steps", r.stdout + r.stderr


def _drop_step(s):
    return lambda r: None if r["event"] == "step" and r["step"] == s else r


def _owners(s, owners):
    return lambda r: {**r, "owners": owners} if r["event"] == "step" and r["step"] == s else r


def _drop(kind, **match):
    return lambda r: None if r["event"] == kind and all(r.get(k) == v for k, v in match.items()) else r


BROKEN = {
    # (the edit of every record, what the audit must say)
    "missing step": (_drop_step(2), "steps without a record: 2"),
    "missing tail": (lambda r: None if r["event"] == "step" and r["step"] >= 1 else r, "steps without a record: 1-3"),
    "duplicate microbatch": (_owners(1, {"0": [0, 1, 2], "1": [2, 3]}), "duplicated [2]"),
    "lost microbatch": (_owners(1, {"0": [0], "1": [2, 3]}), "missing [1]"),
    # a partition of 0..3, but replica 0 never computed microbatch 2 in step 1: the owners check that
    # reads what each member computed, not the record's own keys
    "credited, never computed": (_owners(1, {"0": [0, 1, 2], "1": [3]}), "credited with microbatches [2]"),
    "owner not a member": (_owners(1, {"0": [0, 1], "5": [2, 3]}), "are not the commit members"),
    "no reduce in the commit epoch": (_drop("reduce", step=3, replica=1), "replica 1 has no successful reduce"),
    "members disagree": (lambda r: {**r, "state_digest": "0" * 32} if r["event"] == "applied" and r["step"] == 2
                         and r["replica"] == 1 else r, "applied 2 different parameter digests"),
    "run did not finish": (_drop("run_end"), "did not finish"),
    "run failed": (lambda r: {**r, "ok": False, "error": "every replica was lost"} if r["event"] == "run_end" else r,
                   "every replica was lost"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_audit_fails_on_a_broken_log(clean, tmp_path, name):
    edit, token = BROKEN[name]
    run = copy(clean, tmp_path)
    rewrite(run, edit)
    r = unbroken("audit", str(run))
    assert_fails(r, token)
    assert r.stdout.splitlines()[-1] != "audit: 0 problems"


def test_a_step_recorded_twice_in_one_generation(clean, tmp_path):
    run = copy(clean, tmp_path)
    step1 = next(line for line in lines(run) if '"event":"step"' in line and '"step":1,' in line)
    (run / "events.jsonl").write_text("".join(lines(run)) + step1)
    assert_fails(unbroken("audit", str(run)), "step 1: recorded 2 times in generation 0")


def test_torn_last_line_is_reported(clean, tmp_path):
    run = copy(clean, tmp_path)
    text = "".join(lines(run))
    (run / "events.jsonl").write_text(text + '{"event":"compute","t":1.0,"who":"rep')
    assert_fails(unbroken("audit", str(run)), "torn last line")


def test_corrupt_middle_line_is_one_line_exit_2(clean, tmp_path):
    run = copy(clean, tmp_path)
    ls = lines(run)
    ls[9] = '{"event":"compute","t":1.0,"who":"rep' + ls[10]  # a torn record with the next one appended
    (run / "events.jsonl").write_text("".join(ls))
    assert_fails(unbroken("audit", str(run)), "line 10 is not an event record", code=2)
    assert_fails(unbroken("compare", str(clean), str(run)), "line 10 is not an event record", code=2)


def test_step_record_without_owners_is_one_line_exit_2(clean, tmp_path):
    run = copy(clean, tmp_path)
    rewrite(run, lambda r: {k: v for k, v in r.items() if k != "owners"} if r["event"] == "step" else r)
    assert_fails(unbroken("audit", str(run)), "the record of step 0 lacks owners", code=2)


def test_foreign_or_missing_config(clean, tmp_path):
    run = copy(clean, tmp_path)
    cfg = json.loads((run / "config.json").read_text())
    cfg["run"]["seed"] = 7  # the config.json of another run, dropped into this directory
    (run / "config.json").write_text(json.dumps(cfg))
    assert_fails(unbroken("audit", str(run)), "config.json is not this run's: run.seed = 7")
    (run / "config.json").unlink()
    assert_fails(unbroken("audit", str(run)), "has no config.json", code=2)
    (run / "config.json").write_text("{not json")
    assert_fails(unbroken("audit", str(run)), "config.json is not JSON", code=2)


@pytest.mark.parametrize("name", ["missing step", "missing tail", "run did not finish"])
def test_compare_fails_unless_both_runs_are_complete(clean, tmp_path, name):
    run = copy(clean, tmp_path)
    rewrite(run, BROKEN[name][0])
    for a, b in ((clean, run), (run, clean)):
        r = unbroken("compare", str(a), str(b))
        assert r.returncode == 1, r.stdout[-2000:]
        assert any(line.startswith("incomplete: run ") for line in r.stdout.splitlines()), r.stdout[-2000:]


def test_an_empty_log_is_no_run_one_line_exit_2(clean, tmp_path):
    """An empty events.jsonl holds no run: bad input to audit and compare (as to report, status and
    resume), not a run with problems."""
    run = copy(clean, tmp_path)
    (run / "events.jsonl").write_text("")
    assert_fails(unbroken("audit", str(run)), "no run_start", code=2)
    for a, b in ((clean, run), (run, clean)):
        assert_fails(unbroken("compare", str(a), str(b)), f"{str(run)!r} is not a run directory", code=2)


def test_compare_of_two_empty_runs_is_one_line_exit_2(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events.jsonl").write_text("")
    r = unbroken("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert_fails(r, "no run_start", code=2)
    assert not r.stdout  # no table


def test_compare_checks_every_copy_of_a_redone_step(clean, tmp_path):
    """A step redone after a whole-job restart has two records; a wrong first copy must not hide
    behind a right last one (report.steps keeps only the last)."""
    run = copy(clean, tmp_path)
    ls = lines(run)
    first = next(n for n, line in enumerate(ls) if '"event":"step"' in line and '"step":2,' in line)
    bad = json.loads(ls[first])
    bad["param_digest"] = "f" * 64
    ls[first] = json.dumps(bad) + "\n"
    end = next(n for n, line in enumerate(ls) if '"event":"run_end"' in line)
    good = [line for line in ls if '"event":"step"' in line and '"step":3,' in line]
    restart = json.dumps({"event": "restart", "t": 1.0, "generation": 1, "reason": "test", "source": "memory"})
    ls[end:end] = [restart + "\n", json.dumps({**json.loads(lines(clean)[first])}) + "\n", *good]
    (run / "events.jsonl").write_text("".join(ls))
    r = unbroken("compare", str(clean), str(run))
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == "identical: 3/4 steps", r.stdout[-2000:]


def test_summary_counts_a_corrupt_line_the_audit_refuses(clean, tmp_path):
    """The launcher's summary is written whatever happened, so it reports a corrupt line instead of
    failing; the audit is what refuses the log."""
    from unbroken.observe.runs import summarize
    run = copy(clean, tmp_path)
    ls = lines(run)
    ls[4] = "garbage\n"
    (run / "events.jsonl").write_text("".join(ls))
    assert summarize(run)["corrupt_lines"] == [5]
    assert summarize(clean)["corrupt_lines"] == []
