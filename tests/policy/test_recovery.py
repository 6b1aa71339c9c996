"""The in-step recovery state machine, driven for every replica by a randomized scheduler.

A tiny in-memory world executes the actions (collectives complete only when every member of the epoch
has joined, decisions are compare-and-set, kills remove a replica and bump the epoch at arbitrary points).
Property: after any sequence of failures that leaves a survivor, the step commits exactly once, in one
epoch, and the microbatches held by that epoch's members are 0..M-1, each exactly once. The world also
admits joiners (new ids, never computing this step) and re-forms epochs with the same members at random,
and executes as the trainer does: an epoch that only admits does not disturb the step (rec.disturbs).
"""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.policy import recovery as rec
from unbroken.policy.membership import Membership


class World:
    def __init__(self, replicas, m, weights, rng):
        self.rng, self.m = rng, m
        self.epochs = [(0, tuple(range(replicas)))]
        self.alive = set(range(replicas))
        self.decisions, self.done, self.joined = {}, {}, {}
        self.states, self.queue = {}, {}
        for r in range(replicas):
            self.states[r], acts = rec.start(0, r, 0, range(replicas), m, weights)
            self.queue[r] = list(acts)
        self.applied = {}
        self.joiners = set()  # admitted in a later epoch: they join at the next step, hold nothing here

    def chain_after(self, e):
        return tuple(x for x in self.epochs if x[0] > e)

    @property
    def epoch(self):
        return self.epochs[-1][0]

    def kill(self, r):
        self.alive.discard(r)
        self.epochs.append((self.epoch + 1, tuple(sorted(self.alive | self.joiners))))

    def admit(self):
        self.joiners.add(100 + len(self.joiners))
        self.epochs.append((self.epoch + 1, tuple(sorted(self.alive | self.joiners))))

    def reform(self):
        self.epochs.append((self.epoch + 1, self.epochs[-1][1]))

    def disturbed(self, e):
        return rec.disturbs(dict(self.epochs)[e], self.chain_after(e))

    def try_step(self, r):
        """Execute r's next action if it can proceed; returns False when blocked."""
        action = self.queue[r][0]
        event = None
        match action:
            case rec.Compute(_, mbs):
                event = rec.Computed(mbs)
            case rec.Reduce(_, e, members):
                if self.disturbed(e):
                    event = rec.EpochChanged(self.chain_after(e))
                else:
                    self.joined.setdefault(e, set()).add(r)
                    if self.joined[e] >= set(members):
                        event = rec.Reduced(e)
            case rec.Publish(_, e, held):
                self.done.setdefault(e, {})[r] = held
                event = rec.Published(e, len(self.done[e]))
            case rec.Propose(_, e, outcome):
                won = self.decisions.setdefault(e, outcome)
                event = rec.Decided(e, won, self.chain_after(e) if won == "retry" else ())
            case rec.AwaitDecision(_, e) | rec.AwaitEpoch(_, e):
                if isinstance(action, rec.AwaitDecision) and e in self.decisions:
                    won = self.decisions[e]
                    event = rec.Decided(e, won, self.chain_after(e) if won == "retry" else ())
                elif self.disturbed(e) if isinstance(action, rec.AwaitDecision) else self.epoch > e:
                    event = rec.EpochChanged(self.chain_after(e))
            case rec.Apply(_, e):
                self.applied[r] = e
            case rec.Fence():
                pass
        if event is None and not isinstance(action, (rec.Apply, rec.Fence)):
            return False
        self.queue[r].pop(0)
        if event is not None:
            self.states[r], more = rec.on_event(self.states[r], event)
            self.queue[r].extend(more)
        return True


def run_world(replicas, m, weights, seed, kill_prob, admit_prob=0.0):
    rng = random.Random(seed)
    w = World(replicas, m, weights, rng)
    for _ in range(10_000):
        live = [r for r in sorted(w.alive) if w.queue[r]]
        if not live:
            break
        if len(w.alive) > 1 and rng.random() < kill_prob:
            w.kill(rng.choice(sorted(w.alive)))
            continue
        if len(w.epochs) < 12 and rng.random() < admit_prob:
            w.admit() if rng.random() < 0.7 else w.reform()
            continue
        ready = [r for r in live if w.try_step(r)]
        if not ready and all(not w.queue[r] or not w.try_step(r) for r in live):
            raise AssertionError(f"deadlock: {[(r, w.queue[r][0]) for r in live]}")
    return w


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.integers(0, 2**32), st.floats(0.0, 0.3),
       st.dictionaries(st.integers(0, 7), st.floats(0.2, 3.0)), st.sampled_from([0.0, 0.05, 0.2]))
def test_every_microbatch_reduced_exactly_once(replicas, m, seed, kill_prob, weights, admit_prob):
    w = run_world(replicas, m, weights, seed, kill_prob, admit_prob)
    commits = [e for e, d in w.decisions.items() if d == "commit"]
    assert len(commits) == 1, w.decisions
    e = commits[0]
    members = [r for r in dict(w.epochs)[e] if r not in w.joiners]  # joiners hold nothing of the step
    held = [mb for r in members for mb in w.done[e][r]]
    assert sorted(held) == list(range(m))
    # every survivor applied that very epoch's reduction; nobody else applied anything
    assert {r: w.applied[r] for r in w.alive} == {r: e for r in w.alive}
    assert set(w.applied) <= set(members)


def test_zombie_fences_itself():
    state, _ = rec.start(3, me=2, epoch=0, members=[0, 1, 2], num_microbatches=6)
    state, actions = rec.on_event(state, rec.EpochChanged(((1, (0, 1)),)))
    assert state.phase is rec.Phase.FENCED and isinstance(actions[0], rec.Fence)


def test_reformed_epoch_keeps_the_work_and_reduces_again():
    """A group broken with nobody dead (a collective timed out on a straggler): the coordinator starts
    the same members in a new epoch; the step keeps its work and reduces in that epoch."""
    epoch = Membership(0, (0, 1, 2)).reformed()
    assert epoch == Membership(1, (0, 1, 2))
    state, actions = rec.start(3, me=1, epoch=0, members=[0, 1, 2], num_microbatches=6)
    state, actions = rec.on_event(state, rec.Computed(actions[0].microbatches))
    state, actions = rec.on_event(state, rec.ReduceFailed(0, "timed out"))
    assert actions == (rec.AwaitEpoch(3, 0),)
    state, actions = rec.on_event(state, rec.EpochChanged(((1, epoch.members),)))
    state, actions = rec.on_event(state, rec.Decided(0, "retry", ((1, epoch.members),)))
    assert actions == (rec.Reduce(3, 1, (0, 1, 2)),) and state.held == frozenset({2, 3})


def test_a_member_lost_and_admitted_again_within_the_step_is_not_counted_back_in():
    """Group 1 dies in step 4 (epoch 1 without it) and is admitted again in epoch 2 while step 4 is in
    flight (a shrunk group's survivor, or a fast restart): it holds none of the step's work and waits for
    its heal, so step 4 is reduced by group 0 alone, owning every microbatch, in epoch 1: epoch 2 only
    admits, and a peer already in epoch 1 would stay there (rec.disturbs)."""
    state, actions = rec.start(4, me=0, epoch=0, members=[0, 1], num_microbatches=4)
    state, actions = rec.on_event(state, rec.Computed(actions[0].microbatches))
    chain = ((1, (0,)), (2, (0, 1)))
    state, actions = rec.on_event(state, rec.EpochChanged(chain))
    assert actions == (rec.Propose(4, 0, "retry"),)
    state, actions = rec.on_event(state, rec.Decided(0, "retry", chain))
    assert state.members == (0,) and state.epoch == 1
    assert isinstance(actions[0], rec.Compute) and sorted(actions[0].microbatches) == [2, 3]
    state, actions = rec.on_event(state, rec.Computed(actions[0].microbatches))
    assert actions == (rec.Reduce(4, 1, (0,)),)


def test_an_epoch_that_only_admits_leaves_the_step_in_flight_in_its_epoch():
    """Group 2 is admitted (epoch 1) while step 5 of groups 0 and 1 reduces in epoch 0: nothing of the
    step changes, so it is not disturbed and goes on (commits) in epoch 0; a removal after the admission,
    or a re-form, disturbs it."""
    assert not rec.disturbs((0, 1), ((1, (0, 1, 2)),))
    assert not rec.disturbs((0, 1), ((1, (0, 1, 2)), (2, (0, 1, 2, 3))))
    assert rec.disturbs((0, 1), ((1, (0, 1, 2)), (2, (0, 2))))  # group 1 lost after the admission
    assert rec.disturbs((0, 1), ((1, (0, 1)),))  # a re-form: the epoch's collective broke
    assert rec.disturbs((0, 1), ((1, (0, 2)),))  # one lost, one admitted in the same epoch
    assert not rec.disturbs((0, 1), ())


def test_admissions_mid_step_cost_no_retry():
    """With admissions only (no kill, no re-form) every step commits in its first epoch."""
    for seed in range(50):
        w = World(3, 6, {}, random.Random(seed))
        admitted = 0
        for i in range(40):
            if i in (1, 2, 4, 9):
                w.admit()
                admitted += not w.applied
            for r in sorted(w.alive):
                if w.queue[r]:
                    w.try_step(r)
        assert admitted and w.decisions == {0: "commit"} and w.applied == {0: 0, 1: 0, 2: 0}


def test_unexpected_event_is_rejected():
    state, _ = rec.start(0, me=0, epoch=0, members=[0, 1], num_microbatches=4)
    with pytest.raises(ValueError):
        rec.on_event(state, rec.Reduced(epoch=5))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.dictionaries(st.integers(0, 5), st.floats(0.1, 2.0)),
       st.dictionaries(st.integers(0, 5), st.floats(0.1, 2.0)))
def test_adopting_another_plan_keeps_work_only_when_it_stays_ours(replicas, m, mine, agreed):
    members = list(range(replicas))
    state, actions = rec.start(4, me=0, epoch=2, members=members, num_microbatches=m, weights=mine)
    if actions and isinstance(actions[0], rec.Compute):
        state, _ = rec.on_event(state, rec.Computed(actions[0].microbatches))
    adopted = rec.adopt(state, 2, members, agreed)
    fresh, _ = rec.start(4, me=0, epoch=2, members=members, num_microbatches=m, weights=agreed)
    if adopted is None:
        assert fresh.owners != state.owners
    else:  # the same assignment as a fresh start under the agreed plan, the work done kept
        assert adopted.owners == fresh.owners and adopted.weights == fresh.weights
        assert adopted.held == state.held


def test_adopting_a_plan_of_another_epoch_redoes_the_step():
    state, _ = rec.start(4, me=0, epoch=2, members=[0, 1, 2], num_microbatches=6)
    assert rec.adopt(state, 3, [0, 1], None) is None
    assert rec.adopt(state, 2, [0, 1, 2], {}) == state
