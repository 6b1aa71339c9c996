"""A real 3-replica run of 100 steps that loses replica 1 (SIGKILL mid-all-reduce at step 20) while a test
scrapes the coordinator's /metrics, asks `unbroken status HOST:PORT`, and afterwards reads the TensorBoard files back.

What must hold: the counters move across the loss (epoch 0 -> 1, live groups 3 -> 2, a recovery by cause
`exit`, microbatches redone), every exposed name parses with prometheus_client's own parser and follows its
conventions; TensorBoard's loss series equals the step records' losses; `status` shows the running job
(the dead replica among its members' rows) and the finished run directory. The event log shows the
fault fired and took the replica.
"""
from __future__ import annotations

import json
import os
import shutil
import math
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("tensorboard")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from unbroken import cli  # noqa: E402
from unbroken.api import make_config  # noqa: E402
from unbroken.events import read_events, steps  # noqa: E402
from unbroken.runtime.launcher.launch import launch  # noqa: E402

# Steps take ~30 ms here and the exporter folds the log every 0.5 s: 80 steps after the loss keep the job
# alive ~2.5 s with the new epoch showing, so the scrapes and `status` see it (20 steps after it did not).
STEPS, KILL_AT = 100, 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, labels): value}}} of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {f.name: {"type": f.type, "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value
                                                for s in f.samples}}
            for f in text_string_to_metric_families(text)}


def _value(scrape, family: str, sample: str | None = None, **labels) -> float:
    """A sample's value in one scrape; nan where the scrape has no such family (an empty answer: seen once
    in a full suite, whose other worker's processes take ports too), so every filter on it drops that
    scrape and every comparison with it fails."""
    if family not in scrape:
        return math.nan
    return scrape[family]["samples"].get((sample or family, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Run the job in a thread; scrape every 0.1 s and take `status` of the live job once it lost a replica."""
    tmp = tmp_path_factory.mktemp("metrics")
    port = _free_port()
    cfg = make_config(replicas=3, steps=STEPS, microbatches=6, progress=False, out=str(tmp / "run"),
                      faults=f"kill:replica=1,step={KILL_AT},phase=allreduce", metrics__port=port,
                      metrics__tensorboard=str(tmp / "tb"), optim__schedule="cosine", optim__warmup_steps=5,
                      optim__max_grad_norm=0.5, eval__every=4, eval__split=0.05)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", launch(cfg)))
    runner.start()
    scrapes, live_status = [], None
    while runner.is_alive():
        try:
            scrapes.append(_scrape(port))
        except OSError:  # not serving yet, or already gone
            pass
        if live_status is None and scrapes and _value(scrapes[-1], "unbroken_membership_epoch") >= 1:
            addr = (tmp / "run" / "coordinator.addr").read_text().strip()
            live_status = addr, _cli(["status", addr])
        time.sleep(0.1)
    runner.join()
    return result["r"], scrapes, live_status, tmp


def _cli(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_metrics_move_when_a_replica_is_lost(observed):
    result, scrapes, _, _ = observed
    assert result.ok, result.error
    records = read_events(result.run_dir)
    fault = [r for r in records if r["event"] == "fault"]
    assert [(f["kind"], f["replica"], f["step"]) for f in fault] == [("kill", 1, KILL_AT)]
    assert [r["replica"] for r in records if r["event"] == "member_dead"] == [1]
    assert steps(records)[STEPS - 1]["replicas"] == 2  # it finished without replica 1

    assert len(scrapes) >= 5, "the exporter was not reachable while the run went on"
    before = [s for s in scrapes if _value(s, "unbroken_committed_step") >= 0
              and _value(s, "unbroken_membership_epoch") == 0]
    after = [s for s in scrapes if _value(s, "unbroken_membership_epoch") >= 1]
    assert before and after, f"{len(before)} scrapes before the loss, {len(after)} after"
    b, a = before[-1], after[-1]
    assert _value(b, "unbroken_live_replica_groups") == 3 and _value(a, "unbroken_live_replica_groups") == 2
    assert _value(b, "unbroken_recoveries", "unbroken_recoveries_total", cause="exit") == 0
    assert _value(a, "unbroken_recoveries", "unbroken_recoveries_total", cause="exit") == 1
    assert _value(a, "unbroken_microbatches_redone", "unbroken_microbatches_redone_total") >= 1
    assert _value(a, "unbroken_recovery_seconds", "unbroken_recovery_seconds_count") == 1
    assert _value(a, "unbroken_replica_health", replica="1", state="dead") == 1
    assert _value(a, "unbroken_committed_step") > _value(b, "unbroken_committed_step")
    assert _value(a, "unbroken_committed_tokens", "unbroken_committed_tokens_total") > \
        _value(b, "unbroken_committed_tokens", "unbroken_committed_tokens_total")
    # conventions: our own prefix; counters expose _total; time in _seconds; the parser typed them
    for name, fam in a.items():
        assert name.startswith("unbroken_"), name
        if fam["type"] == "counter":
            assert all(s.endswith(("_total", "_created")) for s, _ in fam["samples"]), name
    assert a["unbroken_recovery_seconds"]["type"] == "histogram"
    assert a["unbroken_recoveries"]["type"] == "counter" and a["unbroken_membership_epoch"]["type"] == "gauge"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tensorboard_loss_equals_the_step_records(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    result, _, _, tmp = observed
    ea = EventAccumulator(str(tmp / "tb"))
    ea.Reload()
    committed = steps(read_events(result.run_dir))
    loss = {e.step: e.value for e in ea.Scalars("loss")}
    assert loss == {s: float(np.float32(r["loss"])) for s, r in committed.items()}  # TB stores float32
    live = {e.step: e.value for e in ea.Scalars("live_replicas")}
    assert live[KILL_AT - 1] == 3 and live[STEPS - 1] == 2
    assert [e.step for e in ea.Scalars("recovery/seconds")] == [KILL_AT]
    assert "faults/text_summary" in ea.Tags()["tensors"]


def test_the_validation_loss_reaches_tensorboard_and_metrics(observed):
    """Each `eval` record's loss is TensorBoard's validation/loss at its step and, once it is the newest,
    /metrics' unbroken_eval_loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    result, scrapes, _, tmp = observed
    evaluated = {e["step"]: e["loss"] for e in read_events(result.run_dir) if e["event"] == "eval"}
    assert sorted(evaluated) == [s for s in range(STEPS) if (s + 1) % 4 == 0]
    ea = EventAccumulator(str(tmp / "tb"))
    ea.Reload()
    assert {e.step: e.value for e in ea.Scalars("validation/loss")} == {
        s: float(np.float32(v)) for s, v in evaluated.items()}
    shown = [_value(s, "unbroken_eval_loss") for s in scrapes]
    assert any(v == v for v in shown) and all(v in evaluated.values() for v in shown if v == v)  # NaN: none yet


def test_the_learning_rate_and_gradient_norm_reach_tensorboard_and_metrics(observed):
    """The step record's lr and grad_norm (the optimizer step's) are what TensorBoard and /metrics show."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    result, scrapes, _, tmp = observed
    committed = steps(read_events(result.run_dir))
    ea = EventAccumulator(str(tmp / "tb"))
    ea.Reload()
    for key in ("lr", "grad_norm"):
        shown = {e.step: e.value for e in ea.Scalars(key)}
        assert shown == {s: float(np.float32(r[key])) for s, r in committed.items()}, key
    assert committed[0]["lr"] < committed[4]["lr"] > committed[STEPS - 1]["lr"]  # warmup, then decay
    last = [s for s in scrapes if _value(s, "unbroken_committed_step") >= 0][-1]
    step = int(_value(last, "unbroken_committed_step"))
    assert _value(last, "unbroken_grad_norm") == committed[step]["grad_norm"] > 0
    assert _value(last, "unbroken_learning_rate") == committed[step]["lr"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_status_of_the_running_job_and_of_the_finished_run(observed):
    result, _, live_status, _ = observed
    assert live_status is not None, "never saw the epoch move while the job ran"
    addr, (code, out, err) = live_status
    assert code == 0 and not err, err
    out = " ".join(out.split())  # whatever rich wrapped
    assert "running" in out and f"coordinator {addr}" in out
    assert "heartbeat" in out and "fenced" in out  # the live members' heartbeats, the dead one's fence mark
    assert "process exited with code -9" in out  # the dead replica's row says why
    assert "kill" in out and "recent faults" in out

    code, out, err = _cli(["status", str(result.run_dir)])
    assert code == 0 and not err, err
    out = " ".join(out.split())
    assert "finished ok" in out and f"step {STEPS}/{STEPS} committed" in out
    assert "recent recoveries" in out and "exit" in out and "0->1" in out
    status = json.loads(json.dumps(__import__("unbroken.runtime.coordinator.status").runtime.coordinator.status.load(str(result.run_dir))))
    assert status["replicas"]["1"]["health"] == "dead" and status["members"] == [0, 2]


class _Store:
    """Stands in for the coordinator's store: the exporter only sets its status key."""

    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_snapshot_and_checkpoint_figures_of_a_real_run(tmp_path):
    """A run with in-memory snapshots every step and DCP checkpoints every 2 steps; its log and checkpoint
    directory exported by a fresh Exporter and scraped over HTTP."""
    from unbroken.runtime.store.keys import status as status_key
    from unbroken.runtime.coordinator.metrics import Exporter
    shm = f"/dev/shm/unbroken/test-metrics-{os.getpid()}"
    cfg = make_config(replicas=2, steps=6, microbatches=4, progress=False, out=str(tmp_path / "run"),
                      snapshot__enabled=True, snapshot__shm_dir=shm, checkpoint__every=2)
    try:
        result = launch(cfg)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert result.ok, result.error
    records = read_events(result.run_dir)
    snaps = [r for r in records if r["event"] == "snapshot"]
    skipped = [r for r in records if r["event"] == "snapshot_skipped"]
    assert snaps and max(r["step"] for r in snaps) == 5
    port, store = _free_port(), _Store()
    exporter = Exporter(result.run_dir, store, port=port, checkpoint_dir=str(result.run_dir / "checkpoints"))
    try:
        exporter.poll(force=True)
        scrape = _scrape(port)
    finally:
        exporter.close()
    assert _value(scrape, "unbroken_snapshot_step") == 5
    assert _value(scrape, "unbroken_snapshots_skipped", "unbroken_snapshots_skipped_total") == len(skipped)
    assert _value(scrape, "unbroken_snapshot_age_seconds") > 0
    assert _value(scrape, "unbroken_checkpoint_step") == 5  # steps 0, 2, 4 and the last, 5, checkpointed
    assert _value(scrape, "unbroken_committed_step") == 5 and _value(scrape, "unbroken_live_replica_groups") == 2
    status = json.loads(store.kv[status_key()])
    assert status["snapshot"]["step"] == 5 and status["checkpoint_step"] == 5 and status["finished"]


def test_a_record_the_fold_cannot_read_never_takes_the_coordinator_down(tmp_path):
    """The exporter runs inside the coordinator: a malformed record is reported once, the job goes on."""
    from unbroken.runtime.store.keys import status as status_key
    from unbroken.runtime.coordinator.metrics import Exporter
    lines = [{"event": "run_start", "t": 1.0, "replicas": 1, "steps": 2, "microbatches": 1, "run_id": "r"},
             {"event": "step", "t": 2.0, "step": 0}]  # no tokens, no loss
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    store = _Store()
    exporter = Exporter(tmp_path, store, tensorboard=str(tmp_path / "tb"))
    exporter.poll(force=True)
    assert json.loads(store.kv[status_key()])["unreadable_records"] == 1  # skipped, not folded half-way
    # TensorBoard's writes fail from here on (as on a full disk)
    exporter.writer.add_scalar = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    with open(tmp_path / "events.jsonl", "a") as f:
        for r in ({"event": "epoch", "t": 3.0, "epoch": 0, "members": [0]},
                  {"event": "step", "t": 4.0, "step": 0, "loss": 5.0, "tokens": 64, "microbatches": 1,
                   "owners": {"0": [0]}, "replicas": 1}):
            f.write(json.dumps(r) + "\n")
    exporter.poll(force=True)  # does not raise: the coordinator goes on
    assert exporter.error is not None and "No space left" in exporter.error
    exporter.poll(force=True)
    status = json.loads(store.kv[status_key()])
    assert status["members"] == [0] and status["step"] == 0 and "No space left" in status["metrics_error"]
    exporter.close()
