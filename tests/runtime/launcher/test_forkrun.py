"""forkrun (runtime/trainer/forkrun.py): torchrun's own agent with its ranks forked from it. Through the product's
launcher, a group's ranks are forked, a rank SIGKILLed makes torchrun restart the whole group (forked
again, new pids), and the survivors' clean ends reach their agents (the run ends); a script that is not
the worker runs as plain torchrun runs it, in fresh interpreters."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import unbroken
from unbroken.events import read_events, steps
from unbroken.runtime.trainer.forkrun import forkable


def test_this_torch_s_agent_can_fork_the_worker():
    assert forkable()  # else the launcher's groups would silently run as fresh interpreters


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_rank_s_group_is_restarted_by_torchrun_forked_again(tmp_path):
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--parallel.group_size=2", "--steps", "6", "--microbatches", "4",
                 "--exact", "--run.restarts=1", "--faults", "kill:replica=0,rank=1,step=2,phase=compute",
                 "--run.progress=false", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_events(out / "events.jsonl")
    starts = [e for e in events if e["event"] == "worker_start"]
    first = {(e["replica"], e["rank"]): e for e in starts if e["restart"] == 0}
    assert set(first) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(e["torchrun"] and e["forked"] == "agent" for e in starts), starts
    [fault] = [e for e in events if e["event"] == "fault"]
    assert (fault["kind"], fault["replica"], fault["rank"]) == ("kill", 0, 1)
    assert fault["pid"] == first[0, 1]["pid"]  # the forked rank itself was killed
    assert any(e["event"] == "member_dead" and e["replica"] == 0 for e in events)
    again = {e["rank"]: e["pid"] for e in starts if e["replica"] == 0 and e["restart"] == 1}
    assert set(again) == {0, 1}  # torchrun stopped rank 0 and restarted both, forked anew
    assert not set(again.values()) & {first[0, 0]["pid"], first[0, 1]["pid"]}
    assert len(steps(events)) == 6
    # the survivor group's ranks ended cleanly: their agent saw both return (else it would wait forever)
    assert [e["code"] for e in events if e["event"] == "exit" and e["replica"] == 1] == [0]


@pytest.mark.timeout(120)
def test_a_script_that_is_not_the_worker_runs_in_fresh_interpreters(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w')"
                      ".write(str('torch' in sys.modules))\n")
    r = subprocess.run([sys.executable, "-m", "unbroken.runtime.trainer.forkrun", "--standalone",
                        "--nproc-per-node=2", str(script), str(tmp_path)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(tmp_path / rank).read_text() for rank in "01"] == ["False", "False"]  # nothing preloaded
