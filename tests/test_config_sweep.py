"""Every key of `unbroken config`, taken to values a user may type by mistake: each numeric key to 0, -1, a
huge value, and (floats) inf and nan; each string or boolean key to a word it does not take. Through the
CLI as `unbroken train` runs it (in this process: the checks before any process starts), each either
passes those checks or ends with exit 2 and one line that names the key or the value. Every combination
that passes then runs for real, grouped into as few `unbroken train` runs as keep each key once, and each
of those runs ends with exit 0.
"""
from __future__ import annotations

import contextlib
import io
import typing

import pytest

from tests.conftest import unbroken
from unbroken import cli
from unbroken.config import SECTIONS
from unbroken.config.domains import DOMAINS

pytestmark = [pytest.mark.timeout(170)]

SMALL = {"run.replicas": "2", "run.steps": "2", "run.microbatches": "2", "launch.progress": "false"}


def small(**tried: str) -> list[str]:
    """A small run's overrides, the tried keys' values in place of its own."""
    return [f"--{k}={v}" for k, v in {**SMALL, **tried}.items()]


def values(tp) -> list[str]:
    if tp is int:
        return ["0", "-1", str(10 ** 12)]
    if tp is float:
        return ["0", "-1", "1e30", "inf", "nan"]
    return ["maybe" if tp is bool else "bogus-word"]


def tries() -> list[tuple[str, str]]:
    return [(f"{name}.{key}", v) for name, cls in SECTIONS.items()
            for key, tp in typing.get_type_hints(cls).items() for v in values(tp)]


def pre_start(key: str, value: str, out: str) -> tuple[int | None, str]:
    """`unbroken train` with `--key=value`, in this process, up to the launch: (exit code, stderr), or
    (None, "") where every check passed and the command would start the run."""
    from unbroken.runtime.launcher import launch as launching

    class Started(Exception):
        pass

    def launch(cfg, *args, **kwargs):
        raise Started

    err = io.StringIO()
    real = launching.launch
    launching.launch = launch
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["train", *small(**{key: value}), "--out", out])
    except Started:
        return None, ""
    finally:
        launching.launch = real
    return code, err.getvalue()


def test_every_numeric_key_has_a_domain():
    numeric = {f"{n}.{k}" for n, cls in SECTIONS.items() for k, tp in typing.get_type_hints(cls).items()
               if tp in (int, float)}
    assert numeric == set(DOMAINS), (numeric - set(DOMAINS), set(DOMAINS) - numeric)


def test_every_key_at_a_wrong_value_runs_or_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    passed, refused = [], 0
    for key, value in tries():
        code, err = pre_start(key, value, str(tmp_path / "out"))
        if code is None:
            passed.append((key, value))
            continue
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (key, value, code, err[-2000:])
        assert "Traceback" not in err and (key in lines[0] or value in lines[0]), (key, value, lines)
        refused += 1
    keys = {k for k, _ in tries()}
    print(f"config sweep: {len(keys)} keys, {len(tries())} values tried: {refused} refused in one line with "
          f"exit 2, {len(passed)} passed the checks and run below: {passed}")
    # the passing ones run for real, each key once a run
    runs: list[dict[str, str]] = []
    for key, value in passed:
        run = next((r for r in runs if key not in r), None)
        if run is None:
            runs.append(run := {})
        run[key] = value
    for n, run in enumerate(runs):
        out = run.pop("launch.out", str(tmp_path / f"run{n}"))
        args = small(**run)
        r = unbroken("train", *args, "--out", out, timeout=120)
        assert r.returncode == 0, (args, r.stderr[-2000:])
    assert refused >= 300 and len(runs) <= 3
