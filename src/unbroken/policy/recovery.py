"""In-step recovery as a pure state machine: `on_event(state, event) -> (state, actions)`.

Owns: what one replica does inside one step when the membership changes under it: which microbatches it
still owes, when it may reduce, when it proposes commit or retry, when it must fence itself.
Does not own: executing any action (the trainer in `runtime/` and the simulator in `sim/` execute them),
how decisions are stored (compare-and-set in the coordinator's store), or the optimizer.

Protocol (docs/design.md, step protocol): compute owned microbatches into the local accumulator -> reduce a copy
in the epoch's group -> publish done(s, e) -> the last to publish proposes commit@e -> everyone follows the
single decision. When the epoch moves in a way that `disturbs` the step (a removal or a re-form; an
epoch that only admits joiners does not: the executor then goes on in the step's epoch): propose retry
for the old epoch (a no-op if it was decided already), follow the decision; on retry replay the membership history into new owners, compute what is still owed,
and reduce again in the new epoch. The local accumulator is never cleared inside a step, so work already
done is kept and only the orphaned microbatches are redone.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from unbroken.policy import workload


class Phase(StrEnum):
    COMPUTE = "compute"
    REDUCE = "reduce"
    DECIDE = "decide"
    COMMITTED = "committed"
    FENCED = "fenced"

    @property
    def terminal(self) -> bool:
        return self in (Phase.COMMITTED, Phase.FENCED)


Chain = tuple[tuple[int, tuple[int, ...]], ...]
"""Membership epochs after the state's epoch, oldest first: ((epoch, members), ...)."""


# ---- actions: what the executor must do next -------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    step: int
    microbatches: tuple[int, ...]  # run forward+backward of each, add into the local accumulator


@dataclass(frozen=True)
class Reduce:
    step: int
    epoch: int  # all-reduce a copy of the accumulator in this epoch's group
    members: tuple[int, ...] = ()  # ... of the step's members (a group admitted in the epoch joins later)


@dataclass(frozen=True)
class Publish:
    step: int
    epoch: int
    held: tuple[int, ...]  # microbatches inside the reduced accumulator, for the audit


@dataclass(frozen=True)
class Propose:
    step: int
    epoch: int
    outcome: str  # "commit" or "retry"; compare-and-set, the winner is the decision


@dataclass(frozen=True)
class AwaitDecision:
    step: int
    epoch: int


@dataclass(frozen=True)
class AwaitEpoch:
    step: int
    epoch: int  # wait until the membership moves past this epoch


@dataclass(frozen=True)
class Apply:
    step: int
    epoch: int  # the reduced gradient of this epoch is final: optimizer step


@dataclass(frozen=True)
class Fence:
    step: int
    reason: str  # this replica is no longer a member: leave without writing anything


Action = Compute | Reduce | Publish | Propose | AwaitDecision | AwaitEpoch | Apply | Fence


# ---- events: what the executor observed -----------------------------------------------------------
@dataclass(frozen=True)
class Computed:
    microbatches: tuple[int, ...]


@dataclass(frozen=True)
class Reduced:
    epoch: int


@dataclass(frozen=True)
class ReduceFailed:
    epoch: int
    reason: str


@dataclass(frozen=True)
class Published:
    epoch: int
    count: int  # publishes of done in the epoch, this one included: one per rank of each member group


@dataclass(frozen=True)
class EpochChanged:
    chain: Chain


@dataclass(frozen=True)
class Decided:
    epoch: int
    outcome: str
    chain: Chain = ()  # epochs after `epoch`; non-empty with "retry"


Event = Computed | Reduced | ReduceFailed | Published | EpochChanged | Decided


@dataclass(frozen=True)
class StepState:
    step: int
    me: int
    epoch: int
    members: tuple[int, ...]
    owners: tuple[int, ...]
    held: frozenset[int]
    phase: Phase
    weights: tuple[tuple[int, float], ...] = ()
    attempt: int = 0
    history: Chain = field(default=())  # every epoch this step went through after its plan
    ranks: int = 1  # shard indices per member (a replica group's G): each published once, when reduced

    @property
    def owed(self) -> frozenset[int]:
        return workload.mine(self.owners, self.me) - self.held


def start(step: int, me: int, epoch: int, members: Sequence[int], num_microbatches: int,
          weights: Mapping[int, float] | None = None, ranks: int = 1) -> tuple[StepState, tuple[Action, ...]]:
    """Begin step `step` from its plan (base epoch, members, quota weights). Call once per step, on each
    of a member's ranks: they run the same machine on the same events, since a member's ranks compute the
    same microbatches (each its share of the sequences) and each reduces its own shard, so a commit needs
    every one of the `ranks` shard indices of every member published (a shard reduced everywhere); a
    rank holding several (a re-formed group's) publishes each."""
    w = tuple(sorted((weights or {}).items()))
    owners = workload.assign(num_microbatches, members, dict(w))
    state = StepState(step, me, epoch, tuple(sorted(members)), owners, frozenset(), Phase.COMPUTE, w, ranks=ranks)
    if me not in state.members:
        return replace(state, phase=Phase.FENCED), (Fence(step, f"replica {me} is not in epoch {epoch}"),)
    return _work(state)


def adopt(state: StepState, epoch: int, members: Sequence[int],
          weights: Mapping[int, float] | None = None) -> StepState | None:
    """`state` under another plan of its step, if the work it holds stays valid there; else None.

    For a member that began computing under its own proposal and then learned that another plan won:
    with the same epoch and members and the same assignment of microbatches (weights that differ a
    little rarely move an integral quota), the work done counts and the step goes on with the agreed
    weights; otherwise the caller must start the step over from the agreed plan. Call before the
    first Reduce, never after a retry."""
    if state.attempt or state.history or epoch != state.epoch or tuple(sorted(members)) != state.members:
        return None
    w = tuple(sorted((weights or {}).items()))
    if workload.assign(len(state.owners), state.members, dict(w)) != state.owners:
        return None
    return replace(state, weights=w)


def on_event(state: StepState, event: Event) -> tuple[StepState, tuple[Action, ...]]:
    """Advance one replica's step by one observed event. Pure; raises ValueError on an impossible event."""
    if state.phase.terminal:
        raise ValueError(f"step {state.step} already ended ({state.phase})")
    match event:
        case Computed(mbs):
            return _work(replace(state, held=state.held | frozenset(mbs)))
        case Reduced(e) if e == state.epoch:
            return replace(state, phase=Phase.DECIDE), (Publish(state.step, e, tuple(sorted(state.held))),)
        case ReduceFailed(e) if e == state.epoch:
            return state, (AwaitEpoch(state.step, e),)
        case Published(e, count) if e == state.epoch:
            if count >= len(state.members) * state.ranks:
                return state, (Propose(state.step, e, "commit"),)
            return state, (AwaitDecision(state.step, e),)
        case EpochChanged(chain):
            if chain and state.me not in chain[-1][1]:
                return _fence(state, chain[-1][0])
            return state, (Propose(state.step, state.epoch, "retry"),)
        case Decided(e, "commit") if e == state.epoch:
            return replace(state, phase=Phase.COMMITTED), (Apply(state.step, e),)
        case Decided(e, "retry", chain) if e == state.epoch and chain:
            return _advance(state, chain)
    raise ValueError(f"unexpected {event!r} in phase {state.phase} of step {state.step}, epoch {state.epoch}")


def disturbs(members: Sequence[int], chain: Chain) -> bool:
    """Whether the epochs of `chain`, after an epoch whose members are `members`, change anything for a
    step of that epoch in flight. An epoch that only admits groups (its members a strict superset of
    the epoch's before it) does not: its joiners join at the next step boundary (`_advance` leaves them
    out of this step), so the step's members, owners, collective group and decision stay those of its
    own epoch, and it goes on there; re-reducing it in the new epoch with the same members cost the
    survivors of a rejoin one more reduction (~0.14 s measured, benchmarks/rejoin.py). A removal does,
    and so does a re-form (the same members again: a collective broke with nobody dead)."""
    before = set(members)
    for _, ms in chain:
        now = set(ms)
        if not before < now:
            return True
        before = now
    return False


def _work(state: StepState) -> tuple[StepState, tuple[Action, ...]]:
    owed = state.owed
    if owed:
        return replace(state, phase=Phase.COMPUTE), (Compute(state.step, tuple(sorted(owed))),)
    return replace(state, phase=Phase.REDUCE), (Reduce(state.step, state.epoch, state.members),)


def _advance(state: StepState, chain: Chain) -> tuple[StepState, tuple[Action, ...]]:
    # A group admitted in a later epoch (a rejoin, policy.membership) joins at the next step boundary,
    # not this step: it holds none of this step's work. Each epoch counts only the step's own members
    # still in every epoch since: a member lost and admitted again within one step (a group shrunk onto
    # its survivor ~0.3 s after it lost a rank) is a joiner too, and it waits for its heal, not this
    # step's reduction (counted back in, it hung the step until the collective timeout: seen under load).
    # Not into trailing epochs that only admit: a peer already in the epoch before them is not disturbed
    # by them (`disturbs`) and stays there, so we go there too (else two epochs' groups, a deadlock until
    # the collective timeout). The first epoch is always taken: after a failed reduction it is the
    # fresh group, even where it only admits.
    while len(chain) > 1 and set(chain[-2][1]) < set(chain[-1][1]):
        chain = chain[:-1]
    alive, kept = set(state.members), []
    for e, ms in chain:
        alive &= set(ms)
        kept.append((e, tuple(m for m in ms if m in alive)))
    chain = tuple(kept)
    epoch, members = chain[-1]
    if state.me not in members:
        return _fence(state, epoch)
    owners = workload.replay(state.owners, [m for _, m in chain], dict(state.weights))
    moved = replace(state, epoch=epoch, members=tuple(sorted(members)), owners=owners,
                    attempt=state.attempt + 1, history=state.history + tuple(chain))
    return _work(moved)


def _fence(state: StepState, epoch: int) -> tuple[StepState, tuple[Action, ...]]:
    return replace(state, phase=Phase.FENCED), (Fence(state.step, f"replica {state.me} was removed in epoch {epoch}"),)
