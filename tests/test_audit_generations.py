"""`unbroken audit` checks every generation of a run that restarted, and what each member says it reduced.

One real run (2 replicas, 8 steps, 4 microbatches, --exact, a snapshot every 3 steps, every trainer
SIGKILLed at step 6) is made once: generation 1 restores the snapshot of step n (3 when the agents
kept up, 0 otherwise) and redoes the steps after it, so steps n+1 .. 5 have a copy in each generation.
Each test breaks a copy of its log where only these checks can see it: a lost record of a redone step
still has generation 0's copy, so "every step has a record" alone would pass it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import unbroken
from unbroken.events import read_events

pytestmark = pytest.mark.timeout(120)

# The launcher fires crash-all once it sees step 5's record; a step takes ~25 ms, and in CI at 35e37ad
# step 6 committed (and its snapshot was taken) before the kill landed, so generation 1 restored step 6
# and redid nothing. Replica 0 sleeps through 20x its step-6 compute (wall time only: the arithmetic never
# sees it, and a slow fault logs no fault event), so the kill lands inside step 6.
RUN = ["--replicas", "2", "--steps", "8", "--microbatches", "4", "--exact", "--run.progress=false",
       "--snapshot.enabled=true", "--snapshot.every=3", "--coord.heartbeat_timeout=5",
       "--faults", "crash-all:step=6; slow:replica=0,from=6,to=7,factor=20,how=sleep"]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> tuple[Path, int]:
    """(the run, the step generation 1 restored)."""
    out = tmp_path_factory.mktemp("restarted") / "run"
    r = unbroken("train", *RUN, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert [e["kind"] for e in events if e["event"] == "fault"] == ["crash-all"]  # the crash fired
    restored = {e["step"] for e in events if e["event"] == "restored"}
    assert len(restored) == 1 and [e for e in events if e["event"] == "restart"], restored
    n = restored.pop()
    assert 0 <= n <= 3  # a snapshot from before the crash: steps n+1 .. 5 were committed twice
    return out, n


def edited(run: Path, tmp_path: Path, edit) -> Path:
    """A copy of `run` whose log is rewritten by `edit(generation, record) -> record | None`."""
    dst = tmp_path / "broken"
    shutil.copytree(run, dst)
    out, gen = [], 0
    for line in (dst / "events.jsonl").read_text().splitlines():
        r = json.loads(line)
        gen += r["event"] == "restart"
        r = edit(gen, r)
        if r is not None:
            out.append(json.dumps(r) + "\n")
    (dst / "events.jsonl").write_text("".join(out))
    return dst


def audit_says(run: Path, token: str) -> None:
    r = unbroken("audit", str(run))
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert any(token in line for line in r.stdout.splitlines()), r.stdout


def drop_step(generation: int, step: int):
    return lambda g, r: None if g == generation and r["event"] == "step" and r["step"] == step else r


def test_the_untouched_run_passes(restarted):
    run, _ = restarted
    r = unbroken("audit", str(run))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "audit: 0 problems", r.stdout + r.stderr


def test_a_lost_first_redone_step_is_caught_though_generation_0_recorded_it(restarted, tmp_path):
    run, n = restarted
    audit_says(edited(run, tmp_path, drop_step(1, n + 1)),
               f"generation 1 restored the state after step {n} but its first step record is step {n + 2}")


def test_a_lost_middle_step_of_a_generation_is_caught(restarted, tmp_path):
    run, n = restarted
    audit_says(edited(run, tmp_path, drop_step(1, n + 2)),
               f"generation 1: steps without a record between its first and last: {n + 2}")


def test_a_last_generation_short_of_the_last_step_is_caught(restarted, tmp_path):
    run, _ = restarted
    audit_says(edited(run, tmp_path, drop_step(1, 7)), "the last generation (1) ends at step 6, not 7")


def test_a_redone_copy_counting_a_microbatch_twice_is_caught(restarted, tmp_path):
    run, n = restarted

    def twice(g, r):
        if g == 1 and r["event"] == "step" and r["step"] == n + 1:
            owners = {k: v for k, v in r["owners"].items()}
            first, second = sorted(owners)
            owners[second] = owners[second] + owners[first][:1]  # one microbatch credited to both
            return {**r, "owners": owners}
        return r

    audit_says(edited(run, tmp_path, twice), f"step {n + 1} (generation 1): microbatches duplicated")


def test_owners_must_be_what_each_member_says_it_reduced(restarted, tmp_path):
    run, _ = restarted

    def fewer(g, r):  # replica 1's own record of its reduce of step 1 names one microbatch fewer
        if g == 0 and r["event"] == "reduce" and r.get("ok") and r["step"] == 1 and r["replica"] == 1:
            return {**r, "microbatches": r["microbatches"][1:]}
        return r

    audit_says(edited(run, tmp_path, fewer), "replica 1 reduced microbatches")
