"""Silent corruption through `unbroken train`: bits flipped in one group's state are caught by the state
agreement check (trainer/agreement.py), the group is healed in place from a peer, and the run's digests
are the failure-free run's (--exact), all asserted from the event log."""
from __future__ import annotations

import math

import pytest

from tests.conftest import BASE, unbroken
from unbroken.events import read_events
from unbroken.observe.runs import compare
from unbroken.policy.corruption import checkers, recomputed
from unbroken.policy.workload import assign
from unbroken.runtime.coordinator.status import load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def applied(events, step: int) -> dict[int, str]:
    return {e["replica"]: e["state_digest"] for e in events if e["event"] == "applied" and e["step"] == step}


def test_flips_caught_at_the_check_are_healed_and_the_run_stays_exact(reference, tmp_path):
    """A parameter's exponent bit on group 2 after step 7 and an optimizer state's mantissa bit on group 3
    after step 3, each at a step the check runs after (state_every=4: steps 3, 7, 11): each is caught at
    once, its group healed from group 0 with no restart, and every committed step's digest, and every
    group's final state, is the failure-free run's."""
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--detect.state_every=4", "--out", str(out), "--faults",
                 "flip:replica=2,step=7,in=param,bit=exponent; flip:replica=3,step=3,in=optimizer,bit=mantissa,tensor=2")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    flips = {(e["replica"], e["step"], e["target"]): e for e in events if e["event"] == "flip"}
    assert set(flips) == {(2, 7, "param"), (3, 3, "optimizer")}
    assert all(f["before"] != f["after"] for f in flips.values())
    assert flips[(2, 7, "param")]["bit"] == 30 and flips[(3, 3, "optimizer")]["bit"] == 22
    caught = {(e["replica"], e["step"]): e for e in events if e["event"] == "corruption"}
    assert set(caught) == {(2, 7), (3, 3)}  # no other group was ever found wrong
    assert all(c["found"] != c["agreed"] and c["donor"] == 0 for c in caught.values())
    healed = {(e["replica"], e["step"], e["side"]) for e in events if e["event"] == "heal" and e.get("why") == "corruption"}
    assert healed == {(2, 7, "joiner"), (2, 7, "donor"), (3, 3, "joiner"), (3, 3, "donor")}
    assert all(e["digest_ok"] for e in events if e["event"] == "heal" and e.get("side") == "joiner")
    assert not [e for e in events if e["event"] in ("member_dead", "worker_start") and e.get("restart")]
    cmp = compare(reference, out)
    assert cmp.identical == cmp.total == 12, [row for row in cmp.rows if not row[3]]
    final, want = applied(events, 11), applied(read_events(reference), 11)
    assert set(final) == {0, 1, 2, 3} and set(final.values()) == set(want.values()) and len(set(want.values())) == 1


def test_a_flip_between_checks_travels_until_the_next_check(reference, tmp_path):
    """A parameter's mantissa bit flipped on group 1 after step 4 (checks after steps 3, 7, 11) is in group 1's gradients
    of steps 5-7, which every group reduces: the committed trajectory leaves the failure-free one from
    step 5 on. The check after step 7 finds group 1 alone against the majority and heals it: from there
    every group holds the same state again (how far a corruption travels: up to state_every steps)."""
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--detect.state_every=4", "--run.step_ahead=off", "--out", str(out),
                 "--faults", "flip:replica=1,step=4,in=param,bit=mantissa,tensor=3,element=5")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "flip"] == [(1, 4)]
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "corruption"] == [(1, 7)]
    rows = {row[0]: row[3] for row in compare(reference, out).rows}  # step -> identical
    assert all(rows[s] for s in range(4)) and not any(rows[s] for s in range(5, 12)), rows
    for step in (8, 11):  # healed: every group holds one state again
        assert len(set(applied(events, step).values())) == 1 and len(applied(events, step)) == 4


def test_a_nan_from_a_flipped_exponent_bit_is_never_committed(reference, tmp_path):
    """A parameter's exponent bit flipped on group 2 after step 5 (no state check before step 7 would
    see it): the next step group 2 computes on it gives a NaN loss and gradient. The finite check finds
    it in group 2's own sum before any of it is reduced, names group 2, and group 2 leaves: its
    microbatches are recomputed by the others, no step commits a non-finite loss, and every committed
    step is the failure-free run's, bit for bit (the digest of step 5's record aside, where group 2
    wrote it: its own state, flipped after that step's optimizer step)."""
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--detect.state_every=4", "--out", str(out),
                 "--faults", "flip:replica=2,step=5,in=param,bit=exponent,tensor=3,element=5")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    (flipped,) = [e for e in events if e["event"] == "flip"]
    assert (flipped["replica"], flipped["step"], flipped["bit"]) == (2, 5, 30)
    (bad,) = [e for e in events if e["event"] == "nonfinite"]
    assert bad["replica"] == 2 and bad["step"] in (6, 7) and bad["loss"] == "nan" and bad["microbatches"]
    assert [(e["replica"], e["reason"]) for e in events if e["event"] == "member_dead"] == \
        [(2, "non-finite gradient or loss: device suspect")]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert all(math.isfinite(s["loss"]) for s in steps.values())
    assert all(2 not in {int(g) for g in s["owners"]} for n, s in steps.items() if n >= bad["step"])  # without it
    # every step's digest is the failure-free one but step 5's where group 2 wrote its record: the digest
    # of its own state, flipped after that step's optimizer step
    differ = [row[0] for row in compare(reference, out).rows if not row[3]]
    proposer = {e["step"]: e["replica"] for e in events if e["event"] == "decision" and e["outcome"] == "commit"}
    assert differ == [] or (differ == [5] and proposer[5] == 2), (differ, proposer)


def test_a_device_that_keeps_corrupting_is_evicted_and_the_run_stays_exact(reference, tmp_path):
    """Group 1 flips a parameter's mantissa bit every 3rd step from step 2 (a device that keeps corrupting),
    checks after every step: found at step 2 and healed, found again at step 5 and evicted (evict_after=2,
    the default): it leaves the run, no flip fires after, and every committed step is the failure-free
    run's (a wrong state is caught at the step it lands in, before any gradient of it is reduced)."""
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--detect.state_every=1", "--out", str(out),
                 "--faults", "flip:replica=1,step=2,in=param,bit=mantissa,every=3")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "flip"] == [(1, 2), (1, 5)]
    assert [(e["replica"], e["step"], e["times"]) for e in events if e["event"] == "corruption"] == [(1, 2, 1), (1, 5, 2)]
    assert [(e["replica"], e["step"], e["side"]) for e in events if e["event"] == "heal"] in (
        [(1, 2, "donor"), (1, 2, "joiner")], [(1, 2, "joiner"), (1, 2, "donor")])  # healed once, not at step 5
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "evicted"] == [(1, 5)]
    assert [(e["replica"], e["reason"]) for e in events if e["event"] == "member_dead"] == \
        [(1, "evicted: state corrupted 2 times")]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert all(1 not in {int(g) for g in s["owners"]} for n, s in steps.items() if n > 5)
    status = load(str(out))  # what `unbroken status` and /metrics show
    assert status["suspects"] == {"1": 2} and status["evicted"] == {"1": 5}
    assert [i["cause"] for i in status["incidents"]] == ["corruption"]
    cmp = compare(reference, out)
    assert cmp.identical == cmp.total == 12, [row for row in cmp.rows if not row[3]]


def test_a_gradient_flip_in_a_recomputed_microbatch_is_outvoted_before_the_commit(reference, tmp_path):
    """recompute_fraction=0.25 draws microbatches 4 and 7 of step 5 (policy.corruption.recomputed, seed 0);
    with equal quotas group 2 owns microbatch 4, and a mantissa bit of its gradient is flipped as its
    backward produces it: a finite, silent error no state check could see (every group would reduce it).
    Groups 3 and 0 (its checkers) compute microbatch 4 again; their digests agree with each other and
    outvote group 2's before anything of step 5 is reduced; group 2 leaves, its microbatches are redone
    by the others, and every committed step is the failure-free run's. No other microbatch of any step
    (each recomputed one compared bit for bit) is found wrong."""
    assert recomputed(5, 8, 0.25) == (4, 7) and assign(8, (0, 1, 2, 3))[4] == 2
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--run.quotas=equal", "--detect.recompute_fraction=0.25", "--out", str(out),
                 "--faults", "flip:replica=2,step=5,in=grad,microbatch=4,bit=mantissa,tensor=3")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    (flipped,) = [e for e in events if e["event"] == "flip"]
    assert (flipped["replica"], flipped["step"], flipped["microbatch"], flipped["target"]) == (2, 5, 4, "grad")
    (caught,) = [e for e in events if e["event"] == "corruption"]
    assert (caught["kind"], caught["step"], caught["microbatch"], caught["wrong"]) == ("gradient", 5, 4, [2])
    digests = caught["digests"]
    assert set(digests) == {"2", *map(str, checkers(2, (0, 1, 2, 3), 4))} and len(set(digests.values())) == 2
    assert [(e["replica"], e["reason"]) for e in events if e["event"] == "member_dead"] == \
        [(2, "gradient outvoted: device suspect")]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert 2 not in {int(g) for g in steps[5]["owners"]}  # step 5 committed without its contribution
    cmp = compare(reference, out)
    assert cmp.identical == cmp.total == 12, [row for row in cmp.rows if not row[3]]
    assert load(str(out))["suspects"] == {"2": 1}


def test_a_flip_in_one_rank_of_an_fsdp_group_heals_that_rank_from_its_peer_rank(tmp_path):
    """Replica groups of 2 FSDP2 ranks: rank 1 of group 1 gets a mantissa bit of its parameter shard flipped
    after step 1; the check after step 1 compares shard index 1 across groups, and only group 1's rank 1
    pulls rank 1 of group 0's shard (parameters and AdamW moments), in place. The run's digests are the
    failure-free run's of the same layout."""
    layout = ["--replicas", "3", "--parallel.group_size=2", "--steps", "4", "--microbatches", "6", "--exact",
              "--run.progress=false", "--coord.heartbeat_timeout=5.0", "--coord.heartbeat_interval=0.1",
              "--detect.state_every=2"]
    ref, out = tmp_path / "reference", tmp_path / "run"
    assert unbroken("train", *layout, "--out", str(ref)).returncode == 0
    r = unbroken("train", *layout, "--out", str(out), "--faults", "flip:replica=1,rank=1,step=1,in=param,bit=mantissa")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    assert [(e["replica"], e.get("rank", 0), e["step"]) for e in events if e["event"] == "flip"] == [(1, 1, 1)]
    assert [(e["replica"], e.get("rank", 0), e["step"]) for e in events if e["event"] == "corruption"] == [(1, 1, 1)]
    heals = {(e["replica"], e.get("rank", 0), e["side"], e["donor"]) for e in events if e["event"] == "heal"}
    assert heals == {(1, 1, "joiner", 0), (1, 1, "donor", 0)}  # rank 0 of each group untouched
    cmp = compare(ref, out)
    assert cmp.identical == cmp.total == 4, [row for row in cmp.rows if not row[3]]


def test_a_checker_with_corrupted_state_is_outvoted_and_leaves(reference, tmp_path):
    """Group 1's parameter mantissa flipped after step 3 (state checks off, no pipelining): at step 4, the
    first it computes on the corrupted state, group 1 checks microbatch 4 (owned by group 2, checkers 1
    and 3), is outvoted by the owner and the other checker, and leaves before any of its step-4 work is
    reduced; its microbatches are redone, and every committed step is the failure-free run's (step 3's
    record aside where group 1 wrote it: its digest of its own, flipped, state)."""
    assert recomputed(4, 8, 0.25) == (4,) and checkers(2, (0, 1, 2, 3), 4) == (1, 3)
    out = tmp_path / "run"
    r = unbroken("train", *BASE, "--run.quotas=equal", "--run.step_ahead=off", "--detect.recompute_fraction=0.25",
                 "--detect.state_every=0", "--out", str(out),
                 "--faults", "flip:replica=1,step=3,in=param,bit=mantissa,tensor=3")
    assert r.returncode == 0, r.stderr[-2000:]
    events = read_events(out)
    outvoted = [(e["replica"], e["step"], e["microbatch"], e["owner"]) for e in events
                if e["event"] == "corruption" and "found" in e]
    assert outvoted == [(1, 4, 4, 2)]
    assert [(e["replica"], e["reason"]) for e in events if e["event"] == "member_dead"] == \
        [(1, "gradient outvoted: device suspect")]
    differ = [row[0] for row in compare(reference, out).rows if not row[3]]
    proposer = {e["step"]: e["replica"] for e in events if e["event"] == "decision" and e["outcome"] == "commit"}
    assert differ == [] or (differ == [3] and proposer[3] == 1), (differ, proposer)
    assert load(str(out))["suspects"] == {"1": 1}
