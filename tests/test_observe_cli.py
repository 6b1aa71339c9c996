"""`unbroken report` on the demo's faulty run (a PNG whose six panels all drew data, tables in the terminal),
and the operator commands' bad input: one line, exit 2, nothing written."""
from __future__ import annotations

import contextlib
import io
import json
import socket
from pathlib import Path

import pytest
from PIL import Image

from unbroken import cli
from unbroken.events import read_events
from unbroken.observe.plot import PANELS


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _one_line_error(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert err.startswith("unbroken: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in names:
        assert n in err, err


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_report_of_the_demos_faulty_run(tmp_path):
    code, out, err = _cli(["demo", "--out", str(tmp_path), "--steps", "8", "--replicas", "2"])
    assert code == 0, err + out[-2000:]
    faulty, ref = tmp_path / "faulty", tmp_path / "reference"
    records = read_events(faulty)
    assert [(r["kind"], r["replica"]) for r in records if r["event"] == "fault"] == [("kill", 1)]
    assert [r["replica"] for r in records if r["event"] == "member_dead"] == [1]
    assert (tmp_path / "report.png").is_file()  # the demo draws with the report's code

    png = tmp_path / "faulty-report.png"
    code, out, err = _cli(["report", str(faulty), "--compare", str(ref), "--png", str(png)])
    assert code == 0 and not err, err
    image = Image.open(png)
    assert image.size == (1100, 1500)
    drawn = json.loads(image.text["Description"])
    assert list(drawn) == list(PANELS)
    assert all(n > 0 for n in drawn.values()), drawn  # every panel drew something of this run
    assert drawn["seconds lost per recovery"] == 1 and drawn["live replica groups"] == 3  # 2 -> 1, held to the end
    assert drawn["loss"] == 16  # 8 steps of the faulty run + 8 of the reference
    assert "faults and recoveries" in out and "kill r1 @" in out and "seconds lost" in out
    assert "loss reference" in out  # the reference's column in the step table


def test_report_refuses_what_is_not_a_finished_run(tmp_path):
    code, _, err = _cli(["report", str(tmp_path)])
    _one_line_error(code, err, str(tmp_path), "not a run directory")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"event": "run_start", "t": 1.0, "replicas": 1, "steps": 3}) + "\n"
                                      + json.dumps({"event": "epoch", "t": 2.0, "epoch": 0, "members": [0]}) + "\n")
    code, _, err = _cli(["report", str(run)])
    _one_line_error(code, err, str(run), "has not finished")
    assert not (run / "report.png").exists()
    (run / "events.jsonl").write_text(json.dumps({"event": "run_start", "t": 1.0, "schema": 99}) + "\n")
    code, _, err = _cli(["report", str(run)])
    _one_line_error(code, err, "schema 99")


def test_status_refuses_a_directory_that_is_not_a_run_and_an_address_that_is_no_coordinator(tmp_path):
    code, _, err = _cli(["status", str(tmp_path)])
    _one_line_error(code, err, str(tmp_path), "not a run directory")
    code, _, err = _cli(["status", str(tmp_path / "missing")])
    _one_line_error(code, err, "missing", "neither a run directory nor HOST:PORT")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = _cli(["status", f"127.0.0.1:{port}"])
    _one_line_error(code, err, f"127.0.0.1:{port}", "cannot reach")
    code, _, err = _cli(["status", str(tmp_path), "--watch", "0"])
    _one_line_error(code, err, "--watch")


def test_train_refuses_a_metrics_port_in_use_before_touching_anything(tmp_path):
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = _cli(["train", "--replicas", "1", "--steps", "1", "--out", str(out),
                             f"--metrics.port={port}"])
    _one_line_error(code, err, f"metrics.port={port}", "cannot listen")
    assert not out.exists()  # no run directory, no processes: nothing half-applied
    code, _, err = _cli(["train", "--out", str(out), "--metrics.port=9400", "--metrics.host=203.0.113.7"])
    _one_line_error(code, err, "203.0.113.7:9400", "cannot listen")  # not an address of this machine
    code, _, err = _cli(["train", "--out", str(out), "--metrics.port=http"])
    _one_line_error(code, err, "metrics.port='http'")
    code, _, err = _cli(["train", "--out", str(out), "--metrics.port=70000"])
    _one_line_error(code, err, "metrics.port=70000")
    assert not out.exists()


def test_status_of_a_finished_run_directory_needs_no_coordinator(tmp_path):
    """A hand-written finished log: the screen reads it without any process running."""
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"event": "run_start", "t": 0.0, "replicas": 2, "steps": 1, "microbatches": 2, "run_id": "run-x"},
            {"event": "epoch", "t": 1.0, "epoch": 0, "members": [0, 1]},
            {"event": "step", "t": 2.0, "step": 0, "loss": 4.5, "tokens": 64, "microbatches": 2, "replicas": 2,
             "epoch": 0, "owners": {"0": [0], "1": [1]}},
            {"event": "run_end", "t": 3.0, "ok": True}]
    (run / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out, err = _cli(["status", str(run)])
    assert code == 0 and not err, err
    assert "run-x" in out and "finished ok" in out and "step 1/1 committed" in out and "no faults" in out
    assert Path(run / "events.jsonl").read_text().count("\n") == 4  # read, never written
    code, watched, err = _cli(["status", str(run), "--watch", "0.1"])  # a finished run: one screen, then done
    assert code == 0 and not err and "finished ok" in watched, err
