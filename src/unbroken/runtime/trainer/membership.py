"""The coordinator's store as a member (a trainer rank) sees it: plans, done counts, decisions.

Owns: every read and write a member makes on the store (`Coordination`): proposals and agreed plans,
publishing done records and counts, the one compare-and-set decision per step and epoch
(`decision/{s}/{e}`: racing proposals resolve to one value that all follow), waits for a decision or a new
epoch, leaving, admission and heal offers, stand-in claims. Does not own: the key names (store/keys.py),
liveness verdicts and epoch changes (coordinator/coordinator.py), or what a member does next (policy).
"""
from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import Store

from unbroken.policy.recovery import Chain, disturbs
from unbroken.runtime.store import keys
from unbroken.runtime.store.watch import CounterWatch, DecisionWatch, EpochWatch
from unbroken.runtime.store.client import get_written, read


@dataclass(frozen=True)
class Plan:
    epoch: int
    members: tuple[int, ...]
    weights: dict[int, float]

    def dumps(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members), "weights": self.weights})

    @staticmethod
    def loads(raw: bytes | str) -> Plan:
        won = json.loads(raw)
        return Plan(won["epoch"], tuple(won["members"]), parse_weights(won["weights"]))


@dataclass(frozen=True)
class Decision:
    """The single decision of a (step, epoch). A commit carries the plan of the next step (the
    proposer's proposal when it proposed), so that no member compare-and-sets one, and names the
    member that writes the step record: its proposer."""
    outcome: str  # "commit" | "retry"
    proposer: int
    plan: Plan | None  # the next step's, on a commit

    def dumps(self) -> str:
        tail = f":{self.plan.dumps()}" if self.plan is not None else ""
        return f"{self.outcome}:{self.proposer}{tail}"

    @staticmethod
    def loads(raw: bytes | str) -> Decision:
        outcome, who, *plan = (raw.decode() if isinstance(raw, bytes) else raw).split(":", 2)
        return Decision(outcome, int(who), Plan.loads(plan[0]) if plan else None)


def parse_weights(raw: bytes | str | dict) -> dict[int, float]:
    """Quota weights as stored (JSON, replica ids as strings) -> {replica: speed}."""
    return {int(k): v for k, v in (raw if isinstance(raw, dict) else json.loads(raw)).items()}


class Coordination:
    """A member's view of the store. Every method is at most a few store round trips (~0.1 ms locally).

    With an `EpochWatch` (the worker always gives one) `epoch()` is a local read; member lists are
    cached, since `members/{e}` never changes once written. With a `DecisionWatch` too (sharing the epoch
    watch's condition), `wait_for` blocks until a decision or an epoch change instead of polling.
    """

    def __init__(self, store: Store, me: int, watch: EpochWatch | None = None,
                 reconnect: Callable[[], Store] | None = None, weights: CounterWatch | None = None,
                 decisions: DecisionWatch | None = None, rank: int = 0):
        self.store, self.me, self.watch, self._weights_watch = store, me, watch, weights
        self.rank = rank  # rank in the member's replica group: rank 0 writes the group's done record
        self._decisions = decisions
        self._reconnect = reconnect
        self._members: dict[int, tuple[int, ...]] = {}
        self._staged: tuple[int, int, tuple[int, ...]] | None = None  # the done record last written
        self._calm: tuple[int, int] | None = None  # (epoch, latest): the epochs after it only admit
        # this process's incarnation of its group: "start", or the epoch that admitted it (set by the join)
        self.incarnation = "start"

    def group_store(self) -> Store:
        """A store for one epoch's collective group to rendezvous on: a client of its own when we can
        connect again. Gloo's rendezvous blocks its client in `wait` (up to the collective timeout) for
        peers that may be dead; on our client that held every store read of the step loop, e.g. the
        member list of the epoch that replaced the dead, for 30 s."""
        return self._reconnect() if self._reconnect else self.store

    # membership -------------------------------------------------------------------------------------
    def epoch(self) -> int:
        return self.watch.current if self.watch else int(get_written(self.store, keys.epoch()))

    def members(self, epoch: int) -> tuple[int, ...]:
        if epoch not in self._members:
            self._members[epoch] = tuple(json.loads(self.store.get(keys.members(epoch))))
        return self._members[epoch]

    def moved(self, epoch: int) -> bool:
        """Whether the membership moved past `epoch` in a way that disturbs a step of that epoch in
        flight (policy.recovery.disturbs): a removal or a re-form does; epochs that only admit joiners
        do not (the step goes on in its epoch; they join at the next step). Cheap when nothing moved
        (a local read); once per new epoch it reads the member lists (cached)."""
        latest = self.epoch()
        if latest <= epoch:
            return False
        if self._calm == (epoch, latest):
            return False
        if disturbs(self.members(epoch), tuple((e, self.members(e)) for e in range(epoch + 1, latest + 1))):
            return True
        self._calm = (epoch, latest)
        return False

    def chain_after(self, epoch: int) -> Chain:
        """Every epoch after `epoch` up to the current one, with its members, oldest first.

        Reads the epoch from the store, not the watch (which learns of a change a round trip later):
        a member that sees a peer's retry decision must find the epoch that peer saw."""
        latest = int(get_written(self.store, keys.epoch()))
        return tuple((e, self.members(e)) for e in range(epoch + 1, latest + 1))

    def is_dead(self, member: int | None = None) -> bool:
        """Whether `member` (default: this one) was declared dead."""
        return self.store.check([keys.dead(self.me if member is None else member)])

    def weights(self, known: tuple[int, dict[int, float]] | None = None) -> tuple[int, dict[int, float]]:
        """(version, the quota weights): `known` as is while the weights watch saw no new version,
        else read from the store (one round trip; every call without a watch)."""
        version = self._weights_watch.current if self._weights_watch else -1
        if known is not None and version == known[0] >= 0:
            return known
        return version, parse_weights(get_written(self.store, keys.weights()))

    def weights_moved(self, known: tuple[int, dict[int, float]]) -> bool:
        """Whether `weights(known)` would read the store: no round trip."""
        return not (self._weights_watch is not None and self._weights_watch.current == known[0] >= 0)

    # the step ---------------------------------------------------------------------------------------
    def proposal(self, weights: dict[int, float]) -> Plan:
        """The plan this member would propose now: the current epoch, its members, `weights` (the
        detector's speeds as last read; {} means equal). No round trip unless the epoch is new."""
        e = self.epoch()
        return Plan(e, self.members(e), dict(weights))

    def agree_plan(self, step: int, mine: Plan) -> Plan:
        """Compare-and-set `mine` as the plan of `step`; returns the plan that won, ours or the stored one.
        For a generation's first step only: a later step's plan comes with the commit before it."""
        return Plan.loads(self.store.compare_set(keys.plan(step), "", mine.dumps()))

    def stage(self, step: int, epoch: int, held: tuple[int, ...], timings: list[tuple[int, int, float]],
              ranks: int = 1) -> None:
        """Write this member's done record of (step, epoch) ahead of `publish`: call while the all-reduce
        is in flight, so the write overlaps it instead of following it. Harmless if the reduce then
        fails: done records are read only for an epoch whose decision is commit, which needs every
        member's `publish`. The group's other ranks computed the same microbatches: rank 0 writes the
        record. Where the group's `ranks` > 1 ranks each time their own part, rank j > 0 writes its own
        device seconds beside it (the coordinator takes the slowest rank's: slowness.group_timings);
        not an all-reduce inside the group to rank 0: that is a blocking collective after the compute,
        ~5% of a 2 x 2 HSDP step on 2 cores (benchmarks/hsdp_overhead.py)."""
        if self.rank == 0:
            doc = {"held": list(held), "timings": timings, **({"ranks": ranks} if ranks > 1 else {})}
            self.store.set(keys.done(step, epoch, self.me), json.dumps(doc))
        elif ranks > 1:
            self.store.set(keys.rank_done(step, epoch, self.me, self.rank),
                           json.dumps({"held": list(held), "seconds": [t[2] for t in timings]}))
        self._staged = (step, epoch, tuple(held))

    def publish(self, step: int, epoch: int, held: tuple[int, ...], timings: list[tuple[int, int, float]],
                staged: bool | None = None, count: int = 1, ranks: int = 1) -> int:
        """Say the all-reduce of (step, epoch) succeeded here (for this rank's shard, or for the `count`
        shard indices a shrunk group's rank reduced); returns how many publishes the epoch has had: one
        per shard index of each member group.
        The done record is written first unless `stage` already wrote this very one (`staged`; None:
        as this view knows, while another view, e.g. the sidecar's, is told by its caller)."""
        if not (self.staged(step, epoch, held) if staged is None else staged):
            self.stage(step, epoch, held, timings, ranks)
        return self.store.add(keys.done_count(step, epoch), count)

    def staged(self, step: int, epoch: int, held: tuple[int, ...]) -> bool:
        """Whether `stage` wrote this very done record last: no round trip."""
        return self._staged == (step, epoch, tuple(held))

    def done_records(self, step: int, epoch: int, members: tuple[int, ...]) -> dict[int, dict]:
        """Each member's done record of (step, epoch) (`stage`): what it held, its timings and, where it
        has several ranks, how many. One round trip; call only for a committed epoch (every member
        published, so every record is there)."""
        values = self.store.multi_get([keys.done(step, epoch, m) for m in members])
        return {m: json.loads(v) for m, v in zip(members, values)}

    def propose(self, step: int, epoch: int, outcome: str, next_plan: Plan | None = None) -> Decision:
        """Compare-and-set the decision of (step, epoch), a commit with `next_plan`, the plan of step + 1;
        returns the decision that won, ours or another member's."""
        mine = Decision(outcome, self.me, next_plan if outcome == "commit" else None)
        return Decision.loads(self.store.compare_set(keys.decision(step, epoch), "", mine.dumps()))

    def decision(self, step: int, epoch: int) -> Decision | None:
        """The decision of (step, epoch), or None: one round trip."""
        value = read(self.store, keys.decision(step, epoch))
        return None if value is None else Decision.loads(value)

    def watch_decision(self, step: int, epoch: int) -> None:
        """Start watching for the decision of (step, epoch) now, so that a later `wait_for` finds it
        without a round trip. A no-op without a decision watch."""
        if self._decisions is not None:
            self._decisions.watch(step, epoch)

    def wait_for(self, step: int, epoch: int, want_decision: bool, timeout_s: float) -> tuple[str, object]:
        """Wait until (step, epoch) is decided (if `want_decision`) or the epoch moves past `epoch`
        (awaiting a decision: in a way that disturbs the step, `moved`).

        Returns ("decided", Decision) or ("moved", chain); a decision wins when both hold. Raises
        TimeoutError after `timeout_s`. With the decision and epoch watches (the worker's case) the
        wait blocks until either pushes a change; without a decision watch it reads the decision every
        0.2 ms at first, backing off to 2 ms.
        """
        deadline = time.monotonic() + timeout_s
        decisions = self._decisions if want_decision else None
        # Awaiting a decision, an epoch that only admits joiners leaves the step be (`moved`); after a
        # failed reduction any new epoch is taken: the step's group is broken, the new one is not.
        moved = (lambda: self.moved(epoch)) if want_decision else (lambda: self.epoch() > epoch)
        if self.watch is not None and (decisions is not None or not want_decision):
            if decisions is not None:
                decisions.watch(step, epoch)
            outcome = lambda: decisions.outcome(step, epoch) if decisions is not None else None  # noqa: E731
            seen = epoch
            while True:
                self.watch.wait_until(lambda: outcome() is not None or self.watch.current > seen,
                                      max(0.0, deadline - time.monotonic()))
                if outcome() is not None:
                    return "decided", Decision.loads(outcome())
                if moved():
                    return "moved", self.chain_after(epoch)
                seen = max(seen, self.epoch())
                if time.monotonic() >= deadline:
                    break
        pause = 0.0002
        while time.monotonic() < deadline:
            if want_decision:
                decided = self.decision(step, epoch)
                if decided is not None:
                    return "decided", decided
            if moved():
                return "moved", self.chain_after(epoch)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 1.5, 0.002)
        raise TimeoutError(f"step {step}: nothing changed in epoch {epoch} for {timeout_s:.0f} s")

    def leave(self, code: int | str) -> None:
        """Report that this member's replica group can train no more (its own process group broke under
        one of its ranks: a peer rank died), as the launcher reports a process's exit: the coordinator
        declares the group dead at its next round instead of after a heartbeat timeout (under torchrun
        the launcher sees no rank's exit, and on a cluster nobody does). Call at most once, on the way
        out; a store that is gone is ignored (the heartbeat timeout still comes). `code`: the exit code, or
        a phrase saying why the group's processes are gone (a restarted group's rank 0 says it for the
        processes torchrun stopped before starting it)."""
        try:
            self.store.set(keys.exited(self.me), str(code))
            self.store.add(keys.exits(), 1)
        except Exception:  # noqa: BLE001 - best effort: the group leaves either way
            pass

    def dead_reason(self) -> str | None:
        """Why this member was declared dead (the coordinator's verdict), or None while it is not."""
        if not self.store.check([keys.dead(self.me)]):
            return None
        return json.loads(self.store.get(keys.dead(self.me)))["reason"]

    def request_reform(self, epoch: int, reason: str) -> None:
        """Ask the coordinator for a new epoch with the same members (a fresh collective group).

        For a member whose wait for a decision or a new epoch in `epoch` timed out: a collective that
        timed out on a live straggler breaks the group without a death, so no epoch would follow by
        itself. Idempotent; a request for an epoch already past is ignored."""
        self.store.set(keys.reform(epoch), json.dumps({"replica": self.me, "reason": reason}))

    def post_shard(self, step: int, digest: str, loss: float, rank: int | None = None) -> None:
        """Rank j > 0 of a group: the digest (accumulator.param_digest) of its shard of the parameters after `step` and its share of
        the step's loss (its shard's loss slot, reduced across groups), for the group's record. `rank`:
        the shard index posted for, when a shrunk group's one rank holds several (default: this rank's)."""
        self.store.set(keys.shard_digest(step, self.me, self.rank if rank is None else rank),
                       json.dumps([digest, loss]))

    def shards(self, step: int, indices: list[int], timeout_s: float) -> list[tuple[str, float]]:
        """Rank 0 of a group: (shard digest, loss share) posted after `step` for each shard index of
        `indices` (those its ranks 1..G-1 hold), in that order. Raises on a timeout (a rank that died
        first: its group is then declared dead anyway)."""
        names = [keys.shard_digest(step, self.me, j) for j in indices]
        self.store.wait(names, datetime.timedelta(seconds=timeout_s))
        return [tuple(json.loads(v)) for v in self.store.multi_get(names)]

    # joining ----------------------------------------------------------------------------------------
    def ask_to_join(self, nonce: str, restart: int, alive: list[int] | None = None) -> None:
        """A restarted or new group's rank 0: ask the coordinator for admission (`admitted` says when).
        `alive`: the survivors of a group that lost ranks, asking to go on shrunk (every one that claimed:
        replan_reform.agree; the coordinator's scheduler may refuse: `admitted` then returns -1)."""
        request = {"nonce": nonce, "restart": restart, **({"alive": alive} if alive is not None else {})}
        self.store.set(keys.join(self.me), json.dumps(request))

    def admitted(self, nonce: str, timeout_s: float) -> int:
        """Wait until the request `nonce` of this group is admitted; returns the epoch that admitted it.
        Raises on a timeout (torch's store error)."""
        self.store.wait([keys.admitted(self.me, nonce)], datetime.timedelta(seconds=timeout_s))
        return int(self.store.get(keys.admitted(self.me, nonce)))

    def claim_standin(self) -> bool:
        """Claim to go on for this group's incarnation (`incarnation`) after it lost a rank; True for the
        first claim, whose survivor asks the coordinator for every survivor that claimed (replan_reform.agree:
        the plan chosen names the ones that go on). Call once, after the group broke. A rank that broke
        late (stuck 30 s in its group's first rendezvous, its peer long since shrunk) claims for the
        incarnation it belonged to, after that request: no plan names it, and it leaves."""
        self.store.set(keys.survivor(self.me, self.incarnation, self.rank), "1")
        return self.store.add(keys.standin(self.me, self.incarnation), 1) == 1

    def survivors(self, group_size: int, incarnation: str) -> list[int]:
        """The ranks of this group's `incarnation` that claimed (`claim_standin`) so far: every survivor of
        its lost rank that noticed. G round trips; the first to claim reads them (replan_reform.agree)."""
        return [j for j in range(group_size) if self.store.check([keys.survivor(self.me, incarnation, j)])]

    def superseded(self) -> bool:
        """Whether its group was admitted again since this process's incarnation began (re-formed on other
        survivors, or restarted): then this process's report of its broken group (`leave`) would declare
        the newer group dead. A survivor blocked on a peer's socket wakes only when that peer's process
        ends, after the others re-formed (seen: 3 of 7 survivors of a 3-D group, 4 s late, fenced the
        stand-in with their reports). One or two round trips."""
        return self.was_admitted() and str(self.admission(self.me)) != self.incarnation

    def was_admitted(self, group: int | None = None) -> bool:
        """Whether this group (or `group`) was admitted into the run before (it joined, or shrank): a
        fresh start of it must rejoin, not train from step 0. One round trip."""
        return self.store.check([keys.joined(self.me if group is None else group)])

    def admission(self, group: int) -> int:
        """The epoch that admitted `group` last (a donor keys the heal by it)."""
        return int(get_written(self.store, keys.joined(group)))

    def heal_failed(self, group: int, admitted: int, now: bool = False) -> bool:
        """Whether a donor rank's heal of `group` (admitted in `admitted`) failed; with `now`, say that
        this rank's did (the joiner is gone: the other donor ranks stop waiting for it). One round trip."""
        if now:
            self.store.set(keys.heal_failed(group, admitted), "1")
            return True
        return self.store.check([keys.heal_failed(group, admitted)])

    def offer_heal(self, group: int, admitted: int, step: int, plan: Plan) -> None:
        """The donor's rank 0: `group` (admitted in `admitted`) gets the state after `step`, then trains
        from step + 1 under `plan`."""
        self.store.set(keys.heal(group, admitted), json.dumps({"step": step, "donor": self.me, "plan": plan.dumps()}))

    def heal_offer(self, admitted: int, timeout_s: float) -> tuple[int, int, Plan]:
        """The joiner: wait for its donor's offer; returns (step healed to, donor, the next step's plan)."""
        self.store.wait([keys.heal(self.me, admitted)], datetime.timedelta(seconds=timeout_s))
        offer = json.loads(self.store.get(keys.heal(self.me, admitted)))
        return offer["step"], offer["donor"], Plan.loads(offer["plan"])

    def report_healed(self, admitted: int, rank: int, received: int) -> None:
        """The joiner's rank `rank`: every heal of its admission in epoch `admitted` is done, `received`
        bytes in all (the coordinator measures a re-plan's cost from it: coordinator/replan_measure.py). Once, after them."""
        self.store.set(keys.healed(self.me, admitted, rank), json.dumps({"bytes": received, "t": time.time()}))

    def claim_signature(self, signature: str) -> str:
        """Compare-and-set the run's config-and-model signature; returns the one that stands."""
        return self.store.compare_set(keys.signature(), "", signature).decode()

    def reclaim_record(self, step: int) -> bool:
        """For a survivor that found `step`'s writer (its commit's proposer) dead with the record
        unwritten: True for the one survivor that writes it instead."""
        return self.store.compare_set(keys.reclaim(step), "", str(self.me)) == str(self.me).encode()

    def recorded(self, step: int) -> bool:
        """Whether `step`'s record is written."""
        return self.store.check([keys.recorded(step)])

    def mark_recorded(self, step: int) -> None:
        """Say `step`'s record is out; it becomes the last committed step (one round trip for both).
        Records come out in step order: a writer publishes the next step only after its record."""
        self.store.multi_set([keys.recorded(step), keys.last_commit()], ["1", str(step)])

    def finish(self) -> None:
        """Call once after the last step: the coordinator stops judging this member's liveness."""
        self.store.set(keys.finished(self.me), "1")
        self.store.add(keys.finished_count(), 1)  # after the key: a watcher that sees the count finds the key

    def failed(self) -> dict | None:
        return json.loads(self.store.get(keys.failed())) if self.store.check([keys.failed()]) else None


class GroupLost(RuntimeError):
    """This rank's group was declared dead because another of its ranks went silent (trainer.fence)."""


class FencedOut(RuntimeError):
    """This process was declared dead (a zombie that woke up): it leaves, writing nothing into a later
    step. Raised by the trainer's fence; the lifecycle ends the process with exit code 3."""
