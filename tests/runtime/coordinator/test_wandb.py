"""Weights & Biases from the coordinator, in W&B's offline mode (never a server): a run with
--metrics.wandb=PROJECT writes one W&B run whose id is the run's, holding every committed step's loss and lr
as the step records say, each evaluation's loss, the injected fault and the recovery it caused; a coordinator that starts again on
the same run (a resume) continues that W&B run from where the last one stopped, logging no step twice. The
assertions read the files W&B wrote (its .wandb log: a LevelDB-style log of protobuf records)."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from tests.conftest import unbroken
from unbroken.events import read_events, steps

pytest.importorskip("wandb")
pytestmark = pytest.mark.timeout(180)


def wandb_records(run_dir: Path) -> list[tuple[str, object]]:
    """(kind, record) of every W&B run file under RUN_DIR/wandb/, oldest run first: ('run', RunRecord),
    ('history', {key: value}) ... as W&B's writer laid them out (7-byte header, 32 KiB blocks of chunks:
    crc32, length, type; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                break
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(chunk)
                chunk = b""
                which = rec.WhichOneof("record_type")
                if which == "run":
                    out.append(("run", rec.run))
                elif which == "history":
                    out.append(("history", {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                            for i in rec.history.item}))
    return out


def test_a_run_logs_its_steps_fault_and_recovery_to_one_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--steps", "5", "--microbatches", "4", "--exact",
                 "--launch.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
                 "--faults", "kill:replica=1,step=2,phase=compute", "--metrics.wandb=unbroken-test",
                 "--optim.schedule=cosine", "--eval.every=2", "--eval.split=0.1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    start = next(e for e in events if e["event"] == "run_start")
    assert [e["replica"] for e in events if e["event"] == "fault"] == [1]
    records = wandb_records(out)
    runs = [rec for kind, rec in records if kind == "run"]
    assert [(x.run_id, x.project) for x in runs] == [(start["run_id"], "unbroken-test")]
    history = [h for kind, h in records if kind == "history"]
    logged = {h["step"]: h for h in history if "loss" in h}
    record = steps(events)
    assert sorted(logged) == list(range(5))
    assert [logged[s]["loss"] for s in range(5)] == [record[s]["loss"] for s in range(5)]
    assert [logged[s]["lr"] for s in range(5)] == [record[s]["lr"] for s in range(5)]
    assert [logged[s]["live_replicas"] for s in range(5)] == [record[s]["replicas"] for s in range(5)]
    faults = [h["events/faults"] for h in history if "events/faults" in h]
    assert len(faults) == 1 and faults[0].startswith("kill at step 2: replica=1"), faults
    recovered = [h for h in history if "recovery/seconds" in h]
    assert [h["step"] for h in recovered] == [2] and recovered[0]["recovery/seconds"] > 0
    evaluated = {e["step"]: e["loss"] for e in events if e["event"] == "eval"}
    assert sorted(evaluated) == [1, 3]
    assert {h["step"]: h["validation/loss"] for h in history if "validation/loss" in h} == evaluated
    assert json.loads((out / "wandb.json").read_text())["id"] == start["run_id"]


def test_a_coordinator_that_starts_again_continues_the_wandb_run_without_logging_twice(tmp_path, monkeypatch):
    """What a resumed run's new coordinator does: the same WandbRun path over the run's log from its start."""
    from unbroken.runtime.coordinator.trackers import Figure, WandbRun

    monkeypatch.setenv("WANDB_MODE", "offline")
    first = WandbRun("p", tmp_path)
    first.log([Figure("loss", 5.0 - s, s, 100.0 + s) for s in (0, 2)], "run-1234")  # a step's record may come late
    first.log([Figure("loss", 4.0, 1, 103.0)], "run-1234")
    first.close()
    # W&B names an offline run's directory by the second it started and the id: a second coordinator in the
    # same second would write into the first one's files (a real resume starts seconds later)
    time.sleep(1.1)
    again = WandbRun("p", tmp_path)  # reads the whole log again: steps 0..4, 0..2 logged already
    again.log([Figure("loss", 5.0 - s, s, 100.0 + s) for s in (0, 2)] + [Figure("loss", 4.0, 1, 103.0)]
              + [Figure("loss", 5.0 - s, s, 101.0 + s) for s in (3, 4)], "run-1234")
    again.close()
    time.sleep(1.1)
    records = wandb_records(tmp_path)
    assert [rec.run_id for kind, rec in records if kind == "run"] == ["run-1234", "run-1234"]
    assert [h["step"] for kind, h in records if kind == "history"] == [0, 2, 1, 3, 4]
    other = WandbRun("p", tmp_path)  # another run in the same directory starts from nothing
    other.log([Figure("loss", 1.0, 0, 50.0)], "run-5678")
    other.close()
    assert [h["step"] for kind, h in wandb_records(tmp_path) if kind == "history"] == [0, 2, 1, 3, 4, 0]
