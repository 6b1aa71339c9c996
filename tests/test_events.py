"""Reading the event log back from its end: whether a dead writer's step record made it out."""
from __future__ import annotations

import pytest

from unbroken.events import EventLog, has_step_record


@pytest.mark.parametrize("chunk", [16, 100, 1 << 20])  # lines cut by chunk boundaries, and none
def test_the_newest_step_record_is_found_from_the_end_within_its_generation(tmp_path, chunk):
    log = EventLog(tmp_path / "events.jsonl", who="replica0")
    log.emit("run_start", replicas=2)
    for s in range(4):
        log.emit("compute", step=s, replica=0, microbatch=0)
        log.emit("step", step=s, loss=1.0, param_digest="ab" * 32)
    log.emit("compute", step=4, replica=0, microbatch=1)  # the next step under way, unrecorded
    path = log.path
    assert has_step_record(path, 3, chunk) and not has_step_record(path, 4, chunk)
    restarted = tmp_path / "restarted.jsonl"
    restarted.write_bytes(path.read_bytes())
    EventLog(restarted).emit("restart", generation=1, reason="x", source="memory")
    assert not has_step_record(restarted, 3, chunk)  # a new generation has none of step 3 yet
    with open(path, "ab") as f:
        f.write(b'{"event":"step","step":4,"lo')  # its writer killed mid-record: no record
    assert not has_step_record(path, 4, chunk) and has_step_record(path, 3, chunk)
