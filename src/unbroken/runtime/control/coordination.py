"""The coordinator's store as members see it: keys, plans, done counts, compare-and-set decisions.

Owns: the key layout of the TCPStore and every read/write a member makes on it. One decision per step and
epoch (`decision/{s}/{e}`) is a compare_set, so racing proposals resolve to one value that all follow.
Does not own: liveness verdicts and epoch changes (coordinator.py), or what a member does next (policy).

Keys (all values utf-8):
  epoch                 current membership epoch (int)          written by the coordinator
  members/{e}           JSON list of member ids of epoch e       coordinator, before `epoch`
  epochs/{e}            "1" once epoch e began (wakes watches)   coordinator, after `epoch`
  dead/{r}              JSON {"epoch", "reason"}                 coordinator (fences zombies)
  reform/{e}            JSON {"replica", "reason"}: epoch e's group broke, nobody died   member
  hb/{r}                JSON {"seq","step","phase","mb","epoch"} member's heartbeat thread (CAS);
                        "fenced" once r was declared dead         coordinator, after dead/{r}
  exit/{r}, nexits      exit code; count of exits                launcher (it sees processes end)
  wakes, wake/{n}       (unprefixed) the coordinator's wake-ups  launcher (epochwatch.wake)
  weights               JSON {replica: speed}, {} = equal        coordinator (detector's speeds; always set)
  nweights, weights/{n} how many times weights changed            coordinator (epochwatch.publish_weights)
  plan/{s}              JSON {"epoch","members","weights"}       CAS by the members, for the first step
                                                                 of a generation only: the plan of every
                                                                 later step comes with the commit of the
                                                                 step before
  done/{s}/{e}/{r}      JSON {"held": [mb...], "timings": [[tokens, sumsq, seconds]...]}   member
  ndone/{s}/{e}         counter                                  member
  decision/{s}/{e}      "commit:{r}:{plan of s+1}" | "retry:{r}" CAS by the proposer r (members wait
                                                                 on it: epochwatch.DecisionWatch); r
                                                                 writes the step record of a commit
  recorded/{s}          "1" once step s's record is written      its writer (with last_commit)
  last_commit           last committed step whose record is out  the record's writer
  reclaim/{s}           a survivor that writes it instead         CAS (the proposer died first)
  finished/{r}          "1" once a member has applied the last step     member
  nfinished             count of finished/{r} keys (watchers re-read those only when it moves)   member
  failed                JSON {"reason","last_committed_step"}    coordinator: every replica lost
"""
from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import Store, TCPStore

from unbroken.policy.recovery import Chain
from unbroken.runtime.control.epochwatch import CounterWatch, DecisionWatch, EpochWatch, decision_key


_MISSING = "\x00missing"


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


def read(store: Store, key: str) -> bytes | None:
    """The value of `key`, or None when it is missing: one round trip, where check-then-get is two.
    A compare_set against a value no key of ours holds returns that value when the key is missing
    (and writes nothing), the stored value otherwise."""
    value = store.compare_set(key, _MISSING, _MISSING)
    return None if value == _MISSING.encode() else value


def last_committed(store: Store, default: int = -1) -> int:
    """The last committed step as the store knows it (`default` before any), for verdicts on a run that
    lost every replica, not for the step loop (a read per epoch): the last step whose record is out
    (`last_commit`), or the step after it when a commit of that one stands but its writer died before
    writing its record with nobody left to write it instead. At most one such step: a writer
    publishes the next step only after its record is out."""
    raw = read(store, "last_commit")
    last = -1 if raw is None else int(raw)
    for e in range(int(read(store, "epoch") or 0) + 1):
        value = read(store, decision_key(last + 1, e))
        if value is not None and value.startswith(b"commit"):
            return last + 1
    return default if raw is None else last


def finished_among(store: Store, ids, seen: tuple[int, frozenset[int]]) -> tuple[int, frozenset[int]]:
    """(nfinished, the members of `ids` that finished): one round trip while the count equals the one in
    `seen` (returned as is), plus a check per id when it moved. Start with (0, frozenset())."""
    n = store.add("nfinished", 0)
    if n == seen[0]:
        return seen
    return n, frozenset(r for r in ids if store.check([f"finished/{r}"]))


def connect(address: str, timeout_s: float = 60.0) -> TCPStore:
    """A client of the coordinator's store at `host:port`. One per thread: clients are not thread-safe."""
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                    use_libuv=True)


class Coordination:
    """A member's view of the store. Every method is at most a few store round trips (~0.1 ms locally).

    With an `EpochWatch` (the worker always gives one) `epoch()` is a local read; member lists are
    cached, since `members/{e}` never changes once written. With a `DecisionWatch` too (sharing the epoch
    watch's condition), `wait_for` blocks until a decision or an epoch change instead of polling.
    """

    def __init__(self, store: Store, me: int, watch: EpochWatch | None = None,
                 reconnect: Callable[[], Store] | None = None, weights: CounterWatch | None = None,
                 decisions: DecisionWatch | None = None):
        self.store, self.me, self.watch, self._weights_watch = store, me, watch, weights
        self._decisions = decisions
        self._reconnect = reconnect
        self._members: dict[int, tuple[int, ...]] = {}
        self._staged: tuple[int, int, tuple[int, ...]] | None = None  # the done record last written

    def group_store(self) -> Store:
        """A store for one epoch's collective group to rendezvous on: a client of its own when we can
        connect again. Gloo's rendezvous blocks its client in `wait` (up to the collective timeout) for
        peers that may be dead; on our client that held every store read of the step loop, e.g. the
        member list of the epoch that replaced the dead, for 30 s."""
        return self._reconnect() if self._reconnect else self.store

    # membership -------------------------------------------------------------------------------------
    def epoch(self) -> int:
        return self.watch.current if self.watch else int(self.store.get("epoch"))

    def members(self, epoch: int) -> tuple[int, ...]:
        if epoch not in self._members:
            self._members[epoch] = tuple(json.loads(self.store.get(f"members/{epoch}")))
        return self._members[epoch]

    def chain_after(self, epoch: int) -> Chain:
        """Every epoch after `epoch` up to the current one, with its members, oldest first.

        Reads the epoch from the store, not the watch (which learns of a change a round trip later):
        a member that sees a peer's retry decision must find the epoch that peer saw."""
        latest = int(self.store.get("epoch"))
        return tuple((e, self.members(e)) for e in range(epoch + 1, latest + 1))

    def is_dead(self, member: int | None = None) -> bool:
        """Whether `member` (default: this one) was declared dead."""
        return self.store.check([f"dead/{self.me if member is None else member}"])

    def weights(self, known: tuple[int, dict[int, float]] | None = None) -> tuple[int, dict[int, float]]:
        """(version, the quota weights): `known` as is while the weights watch saw no new version,
        else read from the store (one round trip; every call without a watch)."""
        version = self._weights_watch.current if self._weights_watch else -1
        if known is not None and version == known[0] >= 0:
            return known
        return version, parse_weights(self.store.get("weights"))

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
        return Plan.loads(self.store.compare_set(f"plan/{step}", "", mine.dumps()))

    def stage(self, step: int, epoch: int, held: tuple[int, ...], timings: list[tuple[int, int, float]]) -> None:
        """Write this member's done record of (step, epoch) ahead of `publish`: call while the all-reduce
        is in flight, so the write overlaps it instead of following it. Harmless if the reduce then
        fails: done records are read only for an epoch whose decision is commit, which needs every
        member's `publish`."""
        self.store.set(f"done/{step}/{epoch}/{self.me}", json.dumps({"held": list(held), "timings": timings}))
        self._staged = (step, epoch, tuple(held))

    def publish(self, step: int, epoch: int, held: tuple[int, ...], timings: list[tuple[int, int, float]],
                staged: bool | None = None) -> int:
        """Say the all-reduce of (step, epoch) succeeded here; returns how many members have said so.
        The done record is written first unless `stage` already wrote this very one (`staged`; None:
        as this view knows, while another view, e.g. the sidecar's, is told by its caller)."""
        if not (self.staged(step, epoch, held) if staged is None else staged):
            self.stage(step, epoch, held, timings)
        return self.store.add(f"ndone/{step}/{epoch}", 1)

    def staged(self, step: int, epoch: int, held: tuple[int, ...]) -> bool:
        """Whether `stage` wrote this very done record last: no round trip."""
        return self._staged == (step, epoch, tuple(held))

    def held(self, step: int, epoch: int, members: tuple[int, ...]) -> dict[int, list[int]]:
        values = self.store.multi_get([f"done/{step}/{epoch}/{m}" for m in members])
        return {m: json.loads(v)["held"] for m, v in zip(members, values)}

    def propose(self, step: int, epoch: int, outcome: str, next_plan: Plan | None = None) -> Decision:
        """Compare-and-set the decision of (step, epoch), a commit with `next_plan`, the plan of step + 1;
        returns the decision that won, ours or another member's."""
        mine = Decision(outcome, self.me, next_plan if outcome == "commit" else None)
        return Decision.loads(self.store.compare_set(decision_key(step, epoch), "", mine.dumps()))

    def decision(self, step: int, epoch: int) -> Decision | None:
        """The decision of (step, epoch), or None: one round trip."""
        value = read(self.store, decision_key(step, epoch))
        return None if value is None else Decision.loads(value)

    def watch_decision(self, step: int, epoch: int) -> None:
        """Start watching for the decision of (step, epoch) now, so that a later `wait_for` finds it
        without a round trip. A no-op without a decision watch."""
        if self._decisions is not None:
            self._decisions.watch(step, epoch)

    def wait_for(self, step: int, epoch: int, want_decision: bool, timeout_s: float) -> tuple[str, object]:
        """Wait until (step, epoch) is decided (if `want_decision`) or the epoch moves past `epoch`.

        Returns ("decided", Decision) or ("moved", chain); a decision wins when both hold. Raises
        TimeoutError after `timeout_s`. With the decision and epoch watches (the worker's case) the
        wait blocks until either pushes a change; without a decision watch it reads the decision every
        0.2 ms at first, backing off to 2 ms.
        """
        deadline = time.monotonic() + timeout_s
        decisions = self._decisions if want_decision else None
        if self.watch is not None and (decisions is not None or not want_decision):
            if decisions is not None:
                decisions.watch(step, epoch)
            outcome = lambda: decisions.outcome(step, epoch) if decisions is not None else None  # noqa: E731
            while True:
                self.watch.wait_until(lambda: outcome() is not None or self.watch.current > epoch,
                                      max(0.0, deadline - time.monotonic()))
                if outcome() is not None:
                    return "decided", Decision.loads(outcome())
                if self.epoch() > epoch:
                    return "moved", self.chain_after(epoch)
                if time.monotonic() >= deadline:
                    break
        pause = 0.0002
        while time.monotonic() < deadline:
            if want_decision:
                decided = self.decision(step, epoch)
                if decided is not None:
                    return "decided", decided
            if self.epoch() > epoch:
                return "moved", self.chain_after(epoch)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 1.5, 0.002)
        raise TimeoutError(f"step {step}: nothing changed in epoch {epoch} for {timeout_s:.0f} s")

    def request_reform(self, epoch: int, reason: str) -> None:
        """Ask the coordinator for a new epoch with the same members (a fresh collective group).

        For a member whose wait for a decision or a new epoch in `epoch` timed out: a collective that
        timed out on a live straggler breaks the group without a death, so no epoch would follow by
        itself. Idempotent; a request for an epoch already past is ignored."""
        self.store.set(f"reform/{epoch}", json.dumps({"replica": self.me, "reason": reason}))

    def reclaim_record(self, step: int) -> bool:
        """For a survivor that found `step`'s writer (its commit's proposer) dead with the record
        unwritten: True for the one survivor that writes it instead."""
        return self.store.compare_set(f"reclaim/{step}", "", str(self.me)) == str(self.me).encode()

    def recorded(self, step: int) -> bool:
        """Whether `step`'s record is written."""
        return self.store.check([f"recorded/{step}"])

    def mark_recorded(self, step: int) -> None:
        """Say `step`'s record is out; it becomes the last committed step (one round trip for both).
        Records come out in step order: a writer publishes the next step only after its record."""
        self.store.multi_set([f"recorded/{step}", "last_commit"], ["1", str(step)])

    def finish(self) -> None:
        """Call once after the last step: the coordinator stops judging this member's liveness."""
        self.store.set(f"finished/{self.me}", "1")
        self.store.add("nfinished", 1)  # after the key: a watcher that sees the count finds the key

    def failed(self) -> dict | None:
        return json.loads(self.store.get("failed")) if self.store.check(["failed"]) else None
