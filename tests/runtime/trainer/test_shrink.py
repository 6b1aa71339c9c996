"""Re-planning at run time (`--parallel.on_rank_loss=replan`): 2 groups of 2 pipeline stages, each rank a
real torchrun agent of its own, in `--exact`, dropout on. A rank of group 1 is SIGKILLed; its group
leaves the step and the survivors redo its microbatches, as under drop; then the coordinator's scheduler
(policy/replan_scheduler.py) chooses between dropping the group and shrinking it onto its surviving rank.

Under shrink the survivor goes on as the whole group (the whole model on one rank, every stage's shard
index: standin.py), healed stage by stage from the matching ranks of group 0, and the run stays bitwise
on the failure-free pipeline trajectory: the same digests at every step (each a sha256 of the two
stages' digests), also through the steps the shrunk group computes. Dropout is on (0.1): the stand-in
re-seeds each microbatch at the stage boundary, as the second stage does. With nothing committed yet to
price the options with, the group is dropped: the survivor leaves, and the run goes on with group 0
alone, still on the trajectory. And a replaced rank, or one its own torchrun agent restarted in place,
grows a shrunk group back to its full plan. Groups of 2 TP ranks shrink (a loss in compute, and one in
the optimizer step that a replacement then grows back) within float32 tolerance, and so does a group of
2 stages x 2 TP ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.trainer.test_groups import assert_held, digests, longer, plain_loop, run_faults, timeline
from tests.runtime.parallel.test_pp_tp import staged, train
from tests.tolerance import assert_within, reorder_bound
from unbroken.config import Config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# progress timeout 120 s (default 20 s): a how=sleep fault sleeps F-1 times its span's wall time, so a span
# that a loaded host stretched (4 replacement workers importing torch) became a 20 s sleep and a healthy
# group 0 was declared stuck: "every replica was lost" (test_a_group_of_four_grows_back..., e1305ff, run
# beside other tests). No test here is about a hang.
# 16 steps: under CI's load a survivor found out by the heartbeat timeout (2 s) was healed at step 7 of 8,
# with no step left for it; steps take ~50 ms here, so 8 more cost ~0.4 s a run
PIPELINE = ["--replicas", "2", "--parallel.group_size=2", "--parallel.pp=2", "--steps", "16", "--microbatches", "4",
            "--exact", "--run.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
            "--coord.run_timeout=150", "--coord.progress_timeout=120"]
# reform 0.1 s: what a shrink here costs (rebuild and heal, ~0.1 s measured on CPU gloo); the cost model's
# default 2 s (an H100 cluster's re-form) would not pay off over the few steps left in an 8-step test
REPLAN = [*PIPELINE, "--parallel.on_rank_loss=replan", "--hardware.reform_seconds=0.1"]
# Group 0 sleeps through 10x its compute in steps 4-11 (wall time only: the detector, the scheduler's
# timings and the arithmetic never see it), so the survivor's rebuild and heal land with shrunk steps
# left however loaded the host (tests run on 2 workers): ~4 s of wall clock, no CPU.
HOLD = "slow:replica=0,from=4,to=12,factor=10,how=sleep"


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "pipeline-reference", PIPELINE)


def within_reordering(cfg: Config, records: dict[int, dict], steps: int, what: str) -> None:
    """Every step's loss within float32 reordering of the plain one-process loop's (tests/tolerance.py: the
    bound derived from a loop whose every sum carries a probable rounding error, over these steps)."""
    plain, bound = reorder_bound(lambda seed: plain_loop(cfg, split=False, digest=lambda model: "", perturb=seed)[2])
    assert_within([records[s]["loss"] for s in range(steps)], plain[:steps], bound, what)


def one(events: list[dict], event: str, **fields) -> dict:
    # a rank-0 fault's event names no rank (one-rank groups' events never do)
    found = [e for e in events if e["event"] == event
             and all(e.get(k, 0 if k == "rank" else None) == v for k, v in fields.items())]
    assert len(found) == 1, f"{len(found)} {event} events with {fields}; the run:\n{timeline(events)}"
    return found[0]


def stand_in_heals(events: list[dict]) -> list[dict]:
    """Group 1's stand-in's heals (joiner side), one per shard index. Only group 1's: under CI's load a
    healthy group 0 was once declared dead too (a TP rank's heartbeat silent 2 s while its sibling slept
    through HOLD, at ed7baee), shrank onto its survivor as it should, and healed from group 1."""
    return [e for e in events if e["event"] == "heal" and e["side"] == "joiner" and e.get("shrunk")
            and e["replica"] == 1]


def assert_measured(events: list[dict], why: str, heals: list[dict], required: bool = True) -> None:
    """The coordinator's `group_plan_measured` for group 1's re-plan (`why`) names what the joiner's heals
    (`heals`, its joiner-side events) moved and when the last ended, beside the decision's predictions,
    over group 1's first 3 committed steps after the heal. Where fewer steps were left (`required`
    False: a grow back's window is timed by a sleep), there must be none."""
    plan = one(events, "group_plan", replica=1, why=why)
    healed = heals[0]["step"]
    records = {e["step"]: e for e in events if e["event"] == "step"}
    after = [s for s in sorted(records) if s > healed and "1" in records[s]["owners"]]
    found = [e for e in events if e["event"] == "group_plan_measured" and e["replica"] == 1 and e["why"] == why]
    if len(after) < 3 and not required:
        assert not found, found
        return
    (m,) = found
    assert (m["applied"], m["plan"], m["steps"]) == (plan["applied"], plan["plan"], after[:3])
    assert m["predicted_weight"] == plan["applied_weight"]
    # a stand-in is one process (rank 0) healing every shard index; a grown group's ranks heal their own
    assert m["healed_ranks"] == (1 if plan["applied"] == "shrink" else len({e.get("rank", 0) for e in heals}))
    assert m["moved_bytes"] == sum(e["bytes"] for e in heals) > 0
    if plan["applied"] == "shrink":  # the survivor pulls its whole holding (it missed a step), as predicted;
        # a heal's embeddings and 12 B a parameter against the model's 16 B a block parameter: measured
        # 1.04-1.08x for one stage or TP rank lost, 1.33x for PP x TP (the replicated rest, 4 heals), 0.92x
        # for FSDP2 shards (each parameter once: no stage holds the tied weight twice)
        assert 0.85 * m["predicted_moved_bytes"] <= m["moved_bytes"] <= 1.5 * m["predicted_moved_bytes"], m
    # from the decision to the joiner's last heal, as the event log's own clock saw both (same host)
    assert abs(m["measured_replan_seconds"] - (max(e["t"] for e in heals) - plan["t"])) < 0.5, m
    assert m["measured_weight"] > 0 and m["measured_step_seconds"] > 0 and m["predicted_step_seconds"] > 0
    # a shrink's quotas follow the measured speed from then on (clamped), unless the detector reweighted it
    if plan["applied"] == "shrink" and m["quota_weight"] is not None:
        assert m["quota_weight"] == round(min(max(m["measured_weight"], 0.1), 4.0), 2)
    elif plan["applied"] == "shrink":
        assert [e for e in events if e["event"] == "group_plan" and e["replica"] == 1 and e["why"] == "slow"
                and e["applied"] == "reweight" and e["step"] <= m["step"]], m
    else:
        assert m["quota_weight"] is None  # a grow's quotas are equal again (ranks back)


def assert_stood_in(events: list[dict], shards: list[int]) -> list[dict]:
    """Group 1's stand-in healed every shard index in `shards` from one donor, then computed its quota of
    a step as all of them (one process); returns its heals."""
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == shards and len({e["donor"] for e in heals}) == 1
    healed = heals[0]["step"]
    records = {e["step"]: e for e in events if e["event"] == "step"}
    shrunk_steps = [s for s in range(healed + 1, 16) if "1" in records[s]["owners"]]
    assert shrunk_steps, "the shrunk group computed no microbatch after it healed"
    stand_in = [e for e in events if e["event"] == "compute" and e["replica"] == 1 and e["step"] > healed]
    assert stand_in and all(e.get("shards") == shards for e in stand_in)
    assert sorted({e["microbatch"] for e in stand_in if e["step"] == shrunk_steps[0]}) == \
        records[shrunk_steps[0]]["owners"]["1"]
    return heals


# alone (no other test on the host meanwhile): under 2 test workers' load these runs found two races of the
# shrink (a joiner counted into the step it left, a record written twice), fixed since; the timing of their
# windows (heal before the end, quotas published while shrunk) is still that of a quiet host
@pytest.mark.alone
@pytest.mark.parametrize("phase,rank", [("compute", 1), ("allreduce", 0), ("commit", 1), ("optimizer", 0)])
def test_a_lost_rank_s_group_goes_on_shrunk_on_its_survivor_bitwise(tmp_path, pipeline_reference, phase, rank):
    out, events = run_faults(tmp_path, f"kill:replica=1,rank={rank},step=3,phase={phase}; {HOLD}", base=REPLAN)
    fault = one(events, "fault", kind="kill", replica=1, rank=rank)
    assert (fault["step"], fault["phase"]) == (3, phase)
    survivor = 1 - rank
    one(events, "group_broken", replica=1, rank=survivor)  # the survivor saw its pipeline peer die
    # it dropped its stage (model, optimizer state, pipeline) before building the whole model
    released = one(events, "released", replica=1, rank=survivor)
    assert (released["parameters"], released["elements"], released["sidecar_idle"]) == (0, 0, True), released
    dead = one(events, "member_dead", replica=1)
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["decision"], plan["applied"], plan["alive"], plan["plan"]) == ("shrink", "shrink", [survivor],
                                                                               "tp1 pp1 [2]")
    assert {o["kind"] for o in plan["options"]} == {"drop", "shrink"}
    assert plan["trajectory"].startswith("bitwise")
    join = one(events, "join", replica=1, shrunk=True)
    assert join["alive"] == [survivor] and join["epoch"] > dead["epoch"]
    # the stand-in computed its microbatches as both stages (one process, the whole model) ...
    heals = assert_stood_in(events, [0, 1])
    records = {e["step"]: e for e in events if e["event"] == "step"}
    assert_ranks_counted(records, join["epoch"], 1 << 30, full=2, shrunk_ranks=1)  # the stand-in: one rank
    assert_measured(events, "rank lost", heals)  # the shrink's cost, measured beside its prediction
    # ... and the run never left the failure-free pipeline trajectory, through the loss and the shrink
    assert digests(out) == digests(pipeline_reference)


@pytest.mark.alone
def test_a_rank_lost_before_any_step_committed_drops_its_group(tmp_path, pipeline_reference):
    """With no committed step there are no measured timings to price the options with: the scheduler is
    not asked (`group_plan_skipped`, naming why), the group is dropped as under `drop`, its survivor
    leaves, and group 0 finishes alone on the same trajectory. Group 0 sleeps through 30x its compute in
    step 0 (wall time only), so that step cannot commit before the survivor asks (0.4 s after the kill):
    under load (2 test workers on 2 cores) it once did, and the scheduler then had timings to price the
    options with. At 100x, a loaded host's first step (imports, warm-up) made the sleep outlast the
    progress timeout (20 s), and group 0 was declared stuck (CI at 6c96962); the timeout is 120 s here."""
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=0,phase=compute; "
                                       "slow:replica=0,from=0,to=1,factor=30,how=sleep",
                             base=REPLAN)
    one(events, "fault", kind="kill", replica=1, rank=1)
    skipped = one(events, "group_plan_skipped", replica=1)
    assert "no timings" in skipped["why"]
    assert not [e for e in events if e["event"] == "group_plan"]
    one(events, "shrink_refused", replica=1)
    assert not [e for e in events if e["event"] == "join"]
    assert all(e["members"] == [0] for e in events if e["event"] == "step")
    assert digests(out) == digests(pipeline_reference)


GROW = ["--replicas", "2", "--parallel.group_size=2", "--parallel.pp=2", "--steps", "32", "--microbatches", "4",
        "--exact", "--run.progress=false", "--coord.heartbeat_timeout=2.5", "--coord.heartbeat_interval=0.1",
        "--coord.run_timeout=150", "--coord.progress_timeout=120", "--model.dropout=0", "--parallel.on_rank_loss=replan",
        "--hardware.reform_seconds=0.1", "--parallel.replace_after=6"]
# Group 0's first stage sleeps 20x its compute from step 4 on (how=sleep: wall time only, which the
# detector does not read and the arithmetic never sees), so that steps take ~0.5 s of wall clock but
# little CPU: the replacement's agent (started 6 s after the loss: under 2 test workers' load, at 0.2 s
# the group grew back 2 steps after it shrank, before its smaller quota was published; at 2.5 s, once
# the agent and its ranks were forked rather than exec'd (~3 s of imports less), the replacement's
# ranks arrived inside the shrunk group's first step and no step committed with it), the lapse of the lost agent's
# rendezvous keep-alives (3 s), the survivor's restart, both workers' start-up and the heal (~7-10 s)
# land by step ~15-20 of 32, and the oracle stays cheap. Dropout 0: the oracle (one process,
# the whole model) draws one dropout stream per microbatch.
# Heartbeat timeout 2.5 s (was 1.5 s): in CI at e1305ff the kill at step 3 never fired, consistent with
# group 1 declared dead in its first steps (a heartbeat thread starved 1.5 s on a loaded host) and
# dropped before step 3.
STRETCH = "slow:replica=0,from=4,factor=20,how=sleep"


def assert_grown_back(events: list[dict], out: Path, dead: list[dict], shrank: bool = True,
                      full: str = "tp1 pp2 [1,1]", steps: int = 32, ranks: int = 2) -> None:
    """Group 1 grew back: the scheduler's `ranks back` decision (grow, to the `full` plan) if it had
    shrunk, one join at the full plan after its last death, its `ranks` ranks healed from a peer and
    computing their own shard again, equal quotas at the last step; for a pipeline or FSDP2 shards, every step's
    digest the plain one-process loop's (a TP group's trajectory is checked by its test: TP 2 -> 1 is not bitwise)."""
    if shrank:
        back = one(events, "group_plan", replica=1, why="ranks back")
        assert back["applied"] == "grow" and back["plan"] == full
    grown = [e for e in events if e["event"] == "join" and e["replica"] == 1 and not e.get("shrunk")]
    assert len(grown) == 1 and grown[0]["epoch"] > dead[-1]["epoch"]
    heals = [e for e in events if e["event"] == "heal" and e["side"] == "joiner" and e["replica"] == 1
             and not e.get("shrunk")]
    assert sorted(e.get("rank", 0) for e in heals) == list(range(ranks))
    healed = heals[0]["step"]
    records = {e["step"]: e for e in events if e["event"] == "step"}
    assert records[steps - 1]["owners"] == {"0": [0, 1], "1": [2, 3]}
    regrown = {e.get("rank", 0) for e in events if e["event"] == "compute" and e["replica"] == 1
               and e["step"] > healed and "shards" not in e}
    assert regrown == set(range(ranks))  # every rank computes again, each its own shard
    if shrank:
        assert_measured(events, "ranks back", heals, required=False)
    if full.startswith("tp1"):  # FSDP2 shards: the split oracle, digested in their layout; stages: in theirs
        cfg = Config.from_json((out / "config.json").read_text())
        fsdp = full.endswith("fsdp2")
        want, _, _ = plain_loop(cfg, split=fsdp, digest=None if fsdp else staged(2))
        assert [digests(out)[s] for s in range(steps)] == want


# alone: its check of the shrunk quotas needs the stand-in to compute a step before the replacement's
# rendezvous restarts it (2.5 s after the loss); beside another test's 16 processes (CI at 9f29495) the
# stand-in healed 4 s after the loss and was restarted before computing any
@pytest.mark.alone
def test_a_replaced_rank_grows_the_shrunk_group_back_to_its_full_plan(tmp_path):
    """Rank 1 of group 1 dies at step 3 with its torchrun agent (its host lost); group 1 goes on shrunk on
    rank 0 with the quota weight of its smaller plan; 6 s after the lost agent ended, the launcher starts
    a replacement agent for it (a spare host), whose rendezvous makes torchrun restart the survivor's
    worker: group 1 is declared dead once more, re-forms with both ranks at its full plan, is healed stage
    by stage from group 0 and takes equal quotas again. Every step's digest is the plain one-process loop's
    (no unbroken code) in stage layout."""
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=3,phase=compute;{STRETCH}", base=GROW)
    one(events, "fault", kind="kill", replica=1, rank=1)
    shrink = one(events, "group_plan", replica=1, why="rank lost")
    assert shrink["applied"] == "shrink"
    shrunk = one(events, "join", replica=1, shrunk=True)
    one(events, "agent_replaced", replica=1, slot=1)
    dead = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    assert len(dead) == 2 and dead[1]["epoch"] > shrunk["epoch"]  # the loss, then the stand-in's restart
    healed = next(e for e in events if e["event"] == "heal" and e["side"] == "joiner" and e["replica"] == 1
                  and not e.get("shrunk"))["step"]
    records = {e["step"]: e for e in events if e["event"] == "step"}
    # quotas: fewer microbatches while shrunk (its plan's weight ~0.5, then its measured speed), equal
    # again once grown back
    assert any(len(records[s]["owners"].get("1", [])) == 1 for s in range(4, healed))
    # each step record counts the ranks that took part: group 1's stand-in as one, between its shrunk
    # join and its second death
    assert_ranks_counted(records, shrunk["epoch"], dead[1]["epoch"], full=2, shrunk_ranks=1)
    assert_grown_back(events, out, dead)


def assert_ranks_counted(records: dict, shrunk: int, regrown: int, full: int, shrunk_ranks: int) -> None:
    """Every step record's `ranks`: group 0's `full`, and group 1's where it took part, `shrunk_ranks` in the
    epochs from `shrunk` (its shrunk join) to `regrown` (the death that re-forms it), else `full`."""
    for r in records.values():
        mine = 0 if 1 not in r["members"] else shrunk_ranks if shrunk <= r["epoch"] < regrown else full
        assert r["ranks"] == full + mine, r
    assert any(r["ranks"] == full + shrunk_ranks for r in records.values())


def test_a_rank_restarted_by_its_own_agent_grows_its_group_back(tmp_path):
    """As above, but the rank's host survives: its process is SIGKILLed (the agent is not), and its own
    torchrun agent, with a restart left (`--run.restarts=1`), starts it again in place, as torchrun
    does on a cluster. That agent's new rendezvous round makes the survivor's agent restart the
    survivor too: the two ranks come back as attempts 1 and 0 of their agents, agree on one admission
    request (admission.agree), and the new rank 0 tells the coordinator that the group's old processes
    are gone (torchrun stopped them), so nobody waits out a stand-in's start-up heartbeat allowance.
    A donor's heal to the stand-in that torchrun stopped mid-heal is given up when the coordinator
    declares it gone or a sibling donor rank gave up (healing.Forming.get). The group then re-forms at
    its full plan, healed from group 0, on the plain loop's trajectory. Whether the survivor asked to
    shrink, or the stand-in computed a step, before torchrun stopped it depends on the host's load (the
    agent restarts within ~3-5 s): the test prints the path it took; on the second (seen in CI under
    load, never in 3 runs alone) it checks the grow back and is reported skipped, naming the path, since
    the shrink it is about did not happen. Each path has a test that takes it every time: the shrink, then
    the grow back, `test_a_replaced_rank_grows_the_shrunk_group_back_to_its_full_plan` (the host lost: no
    torchrun restart races the shrink); the group restarted whole and healed,
    `test_groups.py::test_a_group_restarted_by_torchrun_rejoins_healed_from_a_live_peer` (no re-plan)."""
    base = [a for a in GROW if not a.startswith("--parallel.replace_after")] + ["--run.restarts=1"]
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=1,step=3,phase=compute;{STRETCH}", base=base)
    fault = one(events, "fault", kind="kill", replica=1, rank=1)
    assert "host" not in fault  # the process alone: its agent lives on
    # STRETCH held group 0 (no fault record: wall time only); checked at half its factor: under the full
    # suite one held step read 4.9x the quickest unheld one, where x20 / 4 asks for 5x
    assert_held(events, 0, range(4, 32), factor=10)
    assert not [e for e in events if e["event"] == "agent_replaced"]
    restarted = [e for e in events if e["event"] == "worker_start" and e["replica"] == 1 and e["restart"] == 1]
    assert [e["rank"] for e in restarted] == [1]  # its own agent's attempt 1; the survivor's agent's is 0
    dead = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    asked = [e for e in events if e["event"] == "group_plan" and e["replica"] == 1 and e["why"] == "rank lost"]
    shrunk = [e for e in events if e["event"] == "join" and e["replica"] == 1 and e.get("shrunk")]
    path = (f"shrunk ({len(asked)} plan, {len(shrunk)} shrunk join), then grown back" if asked else
            "rejoined whole: torchrun restarted the survivor before it asked to shrink")
    print(f"rank restarted by its own agent: {path}; group 1 declared dead {len(dead)}x")
    if asked:  # the survivor asked to go on shrunk before torchrun restarted it: 3 of 3 runs alone (2026-12-05)
        assert len(asked) == 1 and len(shrunk) == 1 and len(dead) == 2, (path, dead)  # the loss, the restart
    else:  # under load torchrun restarted the survivor first (seen in CI): the group simply rejoins
        assert len(dead) == 1 and not shrunk, (path, dead)
    assert_grown_back(events, out, dead, shrank=bool(asked))
    if not asked:  # a grow back checked, but not the shrink before it that the test is about: said, not passed
        pytest.skip(f"took the other path: {path}; the shrink then grow back was not exercised here (it is, "
                    f"every time, by test_a_replaced_rank_grows_the_shrunk_group_back_to_its_full_plan)")


TENSOR = ["--replicas", "2", "--parallel.group_size=2", "--parallel.tp=2", "--steps", "16", "--microbatches", "4",
          "--exact", "--run.progress=false", "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1",
          "--coord.run_timeout=150", "--coord.progress_timeout=120", "--model.dropout=0", "--parallel.on_rank_loss=replan",
          "--hardware.reform_seconds=0.1"]


@pytest.mark.parametrize("phase,rank", [("compute", 1), ("allreduce", 0), ("commit", 1)])
def test_a_tensor_parallel_group_goes_on_shrunk_within_float32_tolerance(tmp_path, phase, rank):
    """2 groups of 2 TP ranks: rank `rank` of group 1 dies at step 3 in `phase` (the optimizer phase: the
    grow-back test below); group 1 goes on as its other rank running the whole model (each TP rank's rows
    and columns taken from group 0's ranks, one heal each) and reduces each TP rank's part of the
    gradients in that rank's family. TP 2 -> 1 adds the heads' and units' partial sums in another order,
    so the run is not bitwise: the scheduler's event says so, and every step's loss stays within float32 reordering
    (relative) of a plain one-process loop's (no unbroken code) over 16 steps."""
    out, events = run_faults(tmp_path, f"kill:replica=1,rank={rank},step=3,phase={phase}; {HOLD}", base=TENSOR)
    fault = one(events, "fault", kind="kill", replica=1, rank=rank)
    assert (fault["step"], fault["phase"]) == (3, phase)
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert (plan["applied"], plan["plan"], plan["alive"]) == ("shrink", "tp1 pp1 [2]", [1 - rank])
    assert plan["trajectory"].startswith("within float32 tolerance")
    one(events, "join", replica=1, shrunk=True)
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == [0, 1]
    records = {e["step"]: e for e in events if e["event"] == "step"}
    stand_in = [e for e in events if e["event"] == "compute" and e["replica"] == 1 and e["step"] > heals[0]["step"]]
    assert stand_in and all(e.get("shards") == [0, 1] for e in stand_in)
    cfg = Config.from_json((out / "config.json").read_text())
    within_reordering(cfg, records, 16, f"TP 2 -> 1 in {phase}")


def test_a_tensor_parallel_group_lost_in_its_optimizer_step_shrinks_then_grows_back(tmp_path):
    """2 groups of 2 TP ranks: rank 1 of group 1 dies with its host in step 3's optimizer phase (its sibling
    has reduced, the step's commit may stand). Group 1 shrinks onto rank 0 (the whole model, both TP ranks'
    slices healed from group 0); 2.5 s after the lost agent ended a replacement agent starts, the group is
    declared dead once more, re-forms at TP 2, is healed rank by rank and takes equal quotas again. The
    shrunk steps reorder float32 sums (TP 2 -> 1), so every step's loss is held within float32 reordering (tests/tolerance.py) of
    the plain one-process loop's. Group 0 sleeps 20x its compute in steps 4-11 (wall time only) so the
    replacement lands with steps left; a TP step's compute is the whole group's, so 20x is ~2.5 s a step."""
    grow = [*TENSOR, "--coord.heartbeat_timeout=1.5", "--parallel.replace_after=2.5"]
    out, events = run_faults(tmp_path, "kill:replica=1,rank=1,step=3,phase=optimizer; "
                                       "slow:replica=0,from=4,to=12,factor=20,how=sleep", base=grow)
    fault = one(events, "fault", kind="kill", replica=1, rank=1)
    assert (fault["step"], fault["phase"], fault["host"]) == (3, "optimizer", True)
    shrink = one(events, "group_plan", replica=1, why="rank lost")
    assert (shrink["applied"], shrink["plan"]) == ("shrink", "tp1 pp1 [2]")
    one(events, "join", replica=1, shrunk=True)
    one(events, "agent_replaced", replica=1, slot=1)
    dead = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    assert len(dead) == 2  # the loss, then the stand-in's restart by the replacement's rendezvous
    assert_grown_back(events, out, dead, full="tp2 pp1 [2]", steps=16)
    records = {e["step"]: e for e in events if e["event"] == "step"}
    cfg = Config.from_json((out / "config.json").read_text())
    within_reordering(cfg, records, 16, "TP 2 -> 1 -> 2")


BOTH = [a if a != "--parallel.tp=2" else "--parallel.pp=2" for a in TENSOR]
BOTH[BOTH.index("--parallel.group_size=2")] = "--parallel.group_size=4"
BOTH.append("--parallel.tp=2")  # 2 groups of 2 stages x 2 TP ranks: rank = stage x 2 + TP index


@pytest.fixture(scope="module")
def both_reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory, "both-reference", BOTH)


@pytest.mark.timeout(240)  # 116 s beside the 3-D shrink test on 2 workers (its 8 trainers took 60 s to start)
@pytest.mark.parametrize("phase", ["allreduce", "compute"])
def test_a_pipeline_of_tensor_parallel_stages_re_forms_a_tp_team_bitwise(tmp_path, both_reference, phase):
    """2 groups of 4 ranks (2 stages, TP 2 inside each): rank 3 of group 1 (stage 1, TP index 1) dies
    with its host at step 3, in `phase`. In the cross-group reduction no survivor is blocked inside the
    pipeline, and all three learn of the loss from the coordinator. In compute, stage 0's rank 0 waits
    on a receive from stage 1's survivor, rank 2, and wakes when rank 2 shuts its broken group's sockets
    (sockets.py; before, it woke only when rank 2's process ended, and never claimed). All three
    claim. The scheduler re-forms stage 0's TP team (ranks 0 and 1, whole) as `tp2 pp1 [2]`, running both
    stages (quota weight ~0.50, against ~0.25 for one survivor), and rank 2 leaves. TP rank t of the team holds shard indices t and 2 + t (TP index t of
    both full stages: its DTensors' local shards), each healed from group 0's matching rank. The TP degree
    is kept, so the same kernels compute every microbatch: every step's digest is the failure-free run's
    over 16 steps (bitwise)."""
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=3,step=3,phase={phase}; {HOLD}", base=BOTH)
    one(events, "fault", kind="kill", replica=1, rank=3, phase=phase)
    plan = one(events, "group_plan", replica=1, why="rank lost")
    assert plan["alive"] == [0, 1, 2], plan
    if phase == "compute":  # the survivors shut their ends of the broken group (rank 2: its receive's peer)
        shut = {e["rank"]: e["sockets_shut"] for e in events if e["event"] == "released" and e["replica"] == 1}
        assert sorted(shut) == [0, 1, 2] and sum(shut.values()) > 0, shut
    assert (plan["applied"], plan["applied_plan"], plan["applied_teams"]) == ("shrink", "tp2 pp1 [2]", [[0, 1]]), plan
    assert plan["trajectory"].startswith("bitwise") and not plan["not_executable"], plan
    regroups = {e["rank"]: e for e in events if e["event"] == "regroup" and e["replica"] == 1}
    assert {r: (e["tp"], e["shards"]) for r, e in regroups.items()} == {0: (2, [0, 2]), 1: (2, [1, 3])}, regroups
    left = [e.get("rank", 0) for e in events if e["event"] in ("survivor_left", "fenced") and e["replica"] == 1]
    assert left == [2], left  # the third survivor leaves
    heals = stand_in_heals(events)
    assert sorted(e["rank"] for e in heals) == [0, 1, 2, 3] and len({e["donor"] for e in heals}) == 1
    healed = max(e["step"] for e in heals)
    computed = {tuple(e["shards"]) for e in events if e["event"] == "compute" and e["replica"] == 1
                and e["step"] > healed}
    assert computed == {(0, 2), (1, 3)}, computed
    records = {e["step"]: e for e in events if e["event"] == "step"}
    assert any("1" in records[s]["owners"] for s in range(healed + 1, 16))
    assert digests(out) == digests(both_reference)


@pytest.mark.timeout(240)
def test_a_group_of_four_grows_back_once_every_lost_host_is_replaced(tmp_path):
    """2 groups of 2 stages x TP 2: rank 3 of group 1 dies with its host at step 3; stage 0's TP team
    re-forms the group (both stages on it) and the third survivor leaves (or is fenced), ending its own
    torchrun agent as it goes (release_agent):
    an agent that ends with no restarts left closes the group's rendezvous, and before this every
    replacement failed on it (RendezvousClosedError: 56 of them in a 141 s run, the group never back).
    6 s after, the launcher replaces each ended agent once (spare hosts); torchrun restarts the shrunk
    plan's workers into their rendezvous, and group 1 re-forms at its full plan, healed rank by
    rank. Losses within float32 reordering of the plain one-process loop's (TP 2 throughout). Group 0's first
    rank sleeps 1 s after its compute in every step from step 4 (`for=1`: wall time only) so the re-formed
    group has steps left. It slept 4x its compute before: alone on this host it grew back at steps 11-14
    of 32 (13-17 s after the group's last death), but the project's CI, on a faster host, where a sleep
    of 3x the compute is shorter while the regrowth's fixed waits (replace_after, the lost agent's
    keep-alives lapsing, torchrun's restart) are not, twice healed it only at the run's last step (CI at
    207cec5 and 7c2dc88). A fixed second makes a step last >= 1 s on any host: 28 slowed steps."""
    grow = [*longer(BOTH, 32), "--parallel.replace_after=6", "--coord.run_timeout=220"]
    out, events = run_faults(tmp_path, f"kill:replica=1,rank=3,step=3,phase=compute; "
                                       f"slow:replica=0,from=4,for=1", base=grow)
    assert one(events, "fault", kind="kill", replica=1, rank=3)["host"] is True
    assert_held(events, 0, range(4, 32), stall=1.0)  # group 0's rank 0 stalled 1 s a step from step 4
    # no rank applied a step before every shard index had reduced it: the re-formed group's 2 ranks hold 2
    # each, and counting the group's publishes as its ranks (2, not 4) let it commit ~1 s early in every
    # step group 0's slowed TP-0 ranks reduced last (CI at 0a92ac3: one of those reduces then failed, after
    # the commit). One host: the events' clocks compare.
    reduced, applied = {}, {}
    for e in events:
        if e["event"] == "reduce" and e["ok"]:
            reduced[e["step"], e["epoch"]] = max(reduced.get((e["step"], e["epoch"]), 0.0), e["t"])
        elif e["event"] == "applied":
            applied[e["step"], e["epoch"]] = min(applied.get((e["step"], e["epoch"]), e["t"]), e["t"])
    assert not [k for k, t in applied.items() if t < reduced.get(k, 0.0)], (applied, reduced)
    # The survivors' first claimant asks for a plan once all claimed, or after 3 s (config parallel.claim_wait):
    # that was every time while stage 0's rank 0 stayed blocked in the pipeline on rank 2's socket, before
    # survivors shut their group's sockets (sockets.py; since, all 3 claim within 1 s and stage 0's TP team
    # re-forms, bitwise). A replacement's agent joining the rendezvous before the plan restarts them into
    # the full group first (replace_after=1 and a 3 s wait, alone here: no plan, the group back whole,
    # which is right too); replace_after=6 leaves the shrunk plan its time
    plans = [e for e in events if e["event"] == "group_plan" and e["replica"] == 1 and e["why"] == "rank lost"]
    stayed = [r for team in plans[0]["applied_teams"] for r in team] if plans else []
    # the others leave: on reading a plan without them (survivor_left), or fenced; either way their
    # agents end (the fences after the shrunk join are the regrowth's). Or their agent's rendezvous
    # restarts them first, for the replaced agents (CI at bca5810: rank 2 released, was restarted 14 s
    # later and never read the plan): then its agent was not lost, nor replaced
    shrunk = [e for e in events if e["event"] == "join" and e["replica"] == 1 and e.get("shrunk")]
    before = events[:events.index(shrunk[0])] if shrunk else []
    left = sorted({e.get("rank", 0) for e in before if e["event"] == "fenced" and e["replica"] == 1} |
                  {e.get("rank", 0) for e in events if e["event"] == "survivor_left" and e["replica"] == 1})
    path = (f"re-formed on ranks {stayed} ({plans[0]['applied_plan']}), ranks {left} left, then grown back"
            if plans else f"no plan: the replacements' rendezvous restarted the survivors whole (ranks {left} left)")
    print(f"group of four: {path}")
    # the re-form first is the path replace_after=6 is there for, and every run took (3 of 3 alone,
    # 2026-12-05); the other (no plan, the group restarted whole) was seen only with replace_after=1
    assert plans and shrunk, path
    assert len(plans) == len(shrunk) <= 1 and not set(left) & set(stayed), (path, left, stayed)
    assert set(left) | set(stayed) <= {0, 1, 2}, (path, left, stayed)
    # each lost host once: none failed to join (a re-formed rank that exited at once when its peer was
    # stopped for the grow back failed under its agent, which ended and closed the rendezvous: CI at
    # 65f2418, every slot replaced 4 times; parallelize.outlive_agent_restart)
    replaced = sorted(e["slot"] for e in events if e["event"] == "agent_replaced" and e["replica"] == 1)
    assert replaced == sorted([*left, 3]), (path, replaced)
    assert not [f for f in (out / "logs").glob("replica1*.log") if "RendezvousClosedError" in f.read_text()]
    dead = [e for e in events if e["event"] == "member_dead" and e["replica"] == 1]
    assert_grown_back(events, out, dead, full="tp2 pp2 [1,1]", steps=32, ranks=4)
    records = {e["step"]: e for e in events if e["event"] == "step"}
    # the re-formed team's ranks, counted in the step records while it runs
    regrown = min(e["epoch"] for e in dead if e["epoch"] > shrunk[0]["epoch"])
    assert_ranks_counted(records, shrunk[0]["epoch"], regrown, full=4, shrunk_ranks=len(stayed))
    cfg = Config.from_json((out / "config.json").read_text())
    within_reordering(cfg, records, 32, "TP 2 x PP 2 -> TP 2 -> TP 2 x PP 2")
