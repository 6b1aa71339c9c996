"""A fail-slow rank that is not rank 0 inside a tensor-parallel or FSDP2 (HSDP) replica group, through real
torchrun jobs (2 groups x 2 ranks, gloo, --exact): rank 1 of group 1 spins 3x its compute from step 2.

Its sibling waits for it inside the group's collectives without spending device time, so rank 0's own clock
shows nothing; each rank writes its own device times beside the done record (Coordination.stage) and the
coordinator takes the slowest rank's (slowness.group_timings). Before that, such a rank was declared Slow late or never (a TP run like this one:
at step 14 of 16, at speed 0.79). Oracle: the event log (the fault fired, the verdict, where the scheduler
was told the slow rank is) and the audit (every step reduced all M microbatches, each once).
"""
from __future__ import annotations

import pytest

from tests.conftest import unbroken
from tests.runtime.trainer.test_groups import digests, plain_loop
from unbroken.config import Config
from unbroken.events import read_events, steps
from unbroken.observe.runs import audit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, M = 12, 6
RUN = ["--replicas", "2", "--steps", str(STEPS), "--microbatches", str(M), "--exact", "--run.progress=false",
       "--coord.heartbeat_timeout=3.0", "--coord.run_timeout=200", "--model.dropout=0",
       "--parallel.group_size=2", "--faults", "slow:replica=1,rank=1,from=2,factor=3,how=spin"]


def own_per_token(events: list[dict], replica: int, rank: int, first: int) -> float:
    mine = [e for e in events if e["event"] == "compute" and e["replica"] == replica and e.get("rank") == rank
            and e["step"] >= first]
    return sum(e["seconds"] for e in mine) / sum(e["tokens"] for e in mine)


@pytest.mark.parametrize("layout", ["tp", "hsdp"])
def test_a_slow_rank_1_is_declared_slow_within_a_few_steps(tmp_path, layout):
    out = tmp_path / layout
    extra = ["--parallel.tp=2"] if layout == "tp" else []
    r = unbroken("train", *RUN, *extra, "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    # the fault fired where it was aimed: rank 1 of group 1 took >1.5x its peer's own time per token
    # (3x injected), while its sibling, rank 0, took under 2/3 of that ratio: a spinning rank also slows
    # its sibling's kernels on 2 shared cores (HSDP in CI at f695bf4: 3.80x and 1.31x; TP 3.42x, 1.10x; TP
    # on a loaded host in CI at b0316a2: 2.39x and 1.41x), but a spin aimed at the sibling would put its
    # ratio above the slowed rank's
    slowed = own_per_token(events, 1, 1, 2) / own_per_token(events, 0, 1, 2)
    sibling = own_per_token(events, 1, 0, 2) / own_per_token(events, 0, 0, 2)
    assert slowed > 1.5 and sibling < slowed / 1.5, (slowed, sibling)
    verdicts = [e for e in events if e["event"] == "verdict" and e["new"] == "slow"]
    assert verdicts and {e["replica"] for e in verdicts} == {1}, verdicts
    assert verdicts[0]["step"] <= 6 and verdicts[0]["speed"] < 0.6, verdicts[0]
    plans = [e for e in events if e["event"] == "group_plan"]
    # TP and FSDP2 groups alike are re-planned: the decision was told rank 1 is the slow one
    assert plans and plans[0]["replica"] == 1 and plans[0]["located"] == [1], plans
    # rank 0 not located: healthy, or slowed only by the spinning sibling it shares 2 cores with (CI at
    # 87d01b2: HSDP rank 0 at 0.698 beside rank 1's 0.258; locating.BOUNDING)
    assert plans[0]["rank_speeds"]["1"] < 0.7 and plans[0]["rank_speeds"]["1"] < plans[0]["rank_speeds"]["0"], plans[0]
    full = "tp2 pp1 [2]" if layout == "tp" else "tp1 pp1 [2] fsdp2"
    assert {o["plan"] for o in plans[0]["options"] if o["kind"] in ("keep", "reweight")} == {full}, plans[0]
    record = steps(events)
    assert sorted(record) == list(range(STEPS))
    later = [s for s in record if s > verdicts[0]["step"] + 1]
    assert any(len(record[s]["owners"]["1"]) < len(record[s]["owners"]["0"]) for s in later), record
    assert audit(out, M) == []


def test_under_drop_quotas_a_slow_hsdp_group_is_parked_on_the_split_oracle_s_trajectory(tmp_path):
    """--run.quotas=drop with FSDP2 groups (refused before the scheduler planned them): group 1 is declared
    Slow for its spinning rank 1, the scheduler's decision is logged with drop applied, and from then on
    group 1 owns no microbatch while it stays in every step's reduction (a zero share per shard index);
    every step's digest is the plain one-process loop's, each microbatch's rows split as the shards do."""
    out = tmp_path / "drop"
    r = unbroken("train", *RUN, "--run.quotas=drop", "--steps", "16", "--microbatches", "8", "--out", str(out),
                 timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert own_per_token(events, 1, 1, 2) > 1.5 * own_per_token(events, 0, 1, 2)  # the fault fired
    (plan,) = [e for e in events if e["event"] == "group_plan"]
    assert (plan["replica"], plan["why"], plan["applied"], plan["plan"]) == (1, "slow", "drop", "tp1 pp1 [2] fsdp2")
    assert plan["located"] == [1] and "run.quotas=drop" in plan["not_executable"]["reweight"]
    assert not [e for e in events if e["event"] == "member_dead"]
    record = steps(events)
    parked = [s for s in record if s > plan["step"] and not record[s]["owners"].get("1")]
    assert parked and parked == list(range(parked[0], 16)), {s: record[s]["owners"] for s in record}
    assert all(record[s]["owners"]["0"] == list(range(8)) for s in parked)
    assert audit(out, 8) == []
    cfg = Config.from_json((out / "config.json").read_text())
    want, _, _ = plain_loop(cfg, split=True)
    assert [digests(out)[s] for s in range(16)] == want
