"""Membership epochs and liveness verdicts from heartbeats, as pure values.

Owns: what a membership epoch is (number + sorted member ids), how an epoch follows from the dead set
or from admitted joiners, which member heals a joiner, and which members are stale given when each
heartbeat was last seen to change.
Does not own: receiving heartbeats or storing epochs (the coordinator in `runtime/` does), or clocks:
callers pass times in seconds from their own monotonic clock.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
import dataclasses
from dataclasses import dataclass


# re-formed epochs in a row without a commit before a member is made to leave (Membership.cut_apart): one
# re-form forgives a straggler's timed-out collective, a second with the same members says they cannot form
REFORMS_BEFORE_LEAVING = 2


@dataclass(frozen=True)
class Membership:
    epoch: int
    members: tuple[int, ...]

    @staticmethod
    def initial(replicas: int) -> "Membership":
        return Membership(0, tuple(range(replicas)))

    def without(self, dead: Iterable[int]) -> "Membership":
        """The next epoch with `dead` removed; the same membership if none of them is a member."""
        gone = set(dead) & set(self.members)
        if not gone:
            return self
        return Membership(self.epoch + 1, tuple(m for m in self.members if m not in gone))

    def admit(self, joiners: Iterable[int]) -> "Membership":
        """The next epoch with `joiners` added (replaced or restarted replica groups that asked to join);
        the same membership if all already are members. A step in flight when it begins goes on without
        them (policy.recovery counts only a step's own members); the first step planned in it or later
        includes them, healed first from a donor (`donor`)."""
        new = set(joiners) - set(self.members)
        if not new:
            return self
        return Membership(self.epoch + 1, tuple(sorted(set(self.members) | new)))

    def cut_apart(self, reforms: int) -> int | None:
        """The member that leaves after `reforms` re-formed epochs in a row of this membership committed no
        step (a collective group that never forms: members that reach the coordinator but not each other,
        a cut between their hosts), or None while fewer than `REFORMS_BEFORE_LEAVING`. The highest id goes,
        one per verdict: the lower ids keep training, each verdict's re-formed epoch tests whether the rest
        reach each other, and a group that leaves rejoins when it can reach a donor again. With one member
        left nothing is decided (its own group cannot be cut from itself)."""
        if reforms < REFORMS_BEFORE_LEAVING or len(self.members) < 2:
            return None
        return max(self.members)

    def reformed(self) -> "Membership":
        """The next epoch with the same members: a fresh collective group for an epoch whose group
        broke while nobody died (a collective timed out waiting for a straggler)."""
        return Membership(self.epoch + 1, self.members)


def donor(members: Iterable[int], joiner: int) -> int:
    """The member that heals `joiner` (sends it the state after the step before it joins): joiners
    spread over the members by id, so several joining at once do not all load one donor. Every
    member derives the same answer from the step's members. Raises ValueError without members."""
    ordered = sorted(members)
    if not ordered:
        raise ValueError("no member left to heal from")
    return ordered[joiner % len(ordered)]


@dataclass(frozen=True)
class Beat:
    """What a member last said about itself: where it is, and when the coordinator saw it change."""
    seq: int
    step: int
    phase: str
    microbatch: int
    seen_at: float  # coordinator's monotonic clock, s, when `seq` last changed
    progress_at: float  # ... when (step, phase, microbatch) last changed


def excuse(beats: Mapping[int, Beat], gap: float) -> dict[int, Beat]:
    """The beats as if the last `gap` seconds had not passed: for a coordinator that could not look
    (its store was unavailable, as while an etcd cluster elects a new leader, or it was descheduled),
    so no member is declared dead for silence nobody could have heard."""
    return {m: dataclasses.replace(b, seen_at=b.seen_at + gap, progress_at=b.progress_at + gap)
            for m, b in beats.items()}


def stale(beats: Mapping[int, Beat], members: Iterable[int], now: float, heartbeat_timeout: float,
          progress_timeout: float, startup_timeout: float = 120.0) -> dict[int, str]:
    """Members to declare dead, each with a one-line reason.

    A member is dead when its heartbeat has not changed for `heartbeat_timeout` s (killed, stopped, node
    gone), or when it has sat in the same compute microbatch for `progress_timeout` s while beating
    (alive but stuck). While a member is still starting (phase "start": imports, model build, data
    load, which hold the GIL in long bursts and can starve the heartbeat thread) `startup_timeout` applies
    instead. Members that never beat are not judged here; the launcher reports processes that die.
    """
    verdicts: dict[int, str] = {}
    for m in members:
        b = beats.get(m)
        if b is None:
            continue
        limit = startup_timeout if b.phase == "start" else heartbeat_timeout
        if now - b.seen_at > limit:
            verdicts[m] = f"no heartbeat for {now - b.seen_at:.1f} s"
        elif b.phase == "compute" and now - b.progress_at > progress_timeout:
            verdicts[m] = f"stuck in step {b.step} microbatch {b.microbatch} for {now - b.progress_at:.1f} s"
    return verdicts
