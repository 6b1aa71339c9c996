"""The coordinator's store as members see it: keys, plans, done counts, compare-and-set decisions.

Owns: the key layout of the TCPStore and every read/write a member makes on it. One decision per step and
epoch (`decision/{s}/{e}`) is a compare_set, so racing proposals resolve to one value that all follow.
Does not own: liveness verdicts and epoch changes (coordinator.py), or what a member does next (policy).

Keys (all values utf-8):
  epoch                 current membership epoch (int)          written by the coordinator
  members/{e}           JSON list of member ids of epoch e       coordinator, before `epoch`
  epoch/{e}             "1" once epoch e is complete             coordinator, after `epoch` (EpochWatch)
  dead/{r}              JSON {"epoch", "reason"}                 coordinator (fences zombies)
  hb/{r}                JSON {"seq","step","phase","mb","epoch"} member's heartbeat thread
  exit/{r}, nexits      exit code; count of exits                launcher (it sees processes end)
  weights               JSON {replica: speed}, {} = equal        coordinator (detector's speeds; always set)
  plan/{s}              JSON {"epoch","members","weights"}       first member to start step s (CAS)
  done/{s}/{e}/{r}      JSON {"held": [mb...], "timings": [[tokens, sumsq, seconds]...]}   member
  ndone/{s}/{e}         counter                                  member
  decision/{s}/{e}      "commit:{r}" | "retry:{r}"               CAS by the proposer r
  applied/{s}           counter; the first to apply writes the step record
  last_commit           last committed step                      first member to apply it
  finished/{r}          "1" once a member has applied the last step     member
  failed                JSON {"reason","last_committed_step"}    coordinator: every replica lost
"""
from __future__ import annotations

import datetime
import json
import time
from concurrent.futures import Future
from dataclasses import dataclass

from torch.distributed import Store, TCPStore

from unbroken.policy.recovery import Chain
from unbroken.runtime.epochwatch import EpochWatch


_MISSING = "\x00missing"


@dataclass(frozen=True)
class Plan:
    epoch: int
    members: tuple[int, ...]
    weights: dict[int, float]


def connect(address: str, timeout_s: float = 60.0) -> TCPStore:
    """A client of the coordinator's store at `host:port`. One per thread: clients are not thread-safe."""
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                    use_libuv=True)


class Coordination:
    """A member's view of the store. Every method is at most a few store round trips (~0.1 ms locally).

    With an `EpochWatch` (the worker always gives one) `epoch()` is a local read; member lists are
    cached, since `members/{e}` never changes once written.
    """

    def __init__(self, store: Store, me: int, watch: EpochWatch | None = None):
        self.store, self.me, self.watch = store, me, watch
        self._members: dict[int, tuple[int, ...]] = {}

    # membership -------------------------------------------------------------------------------------
    def epoch(self) -> int:
        return self.watch.current if self.watch else int(self.store.get("epoch"))

    def members(self, epoch: int) -> tuple[int, ...]:
        if epoch not in self._members:
            self._members[epoch] = tuple(json.loads(self.store.get(f"members/{epoch}")))
        return self._members[epoch]

    def chain_after(self, epoch: int) -> Chain:
        """Every epoch after `epoch` up to the current one, with its members, oldest first."""
        return tuple((e, self.members(e)) for e in range(epoch + 1, self.epoch() + 1))

    def is_dead(self) -> bool:
        return self.store.check([f"dead/{self.me}"])

    # the step ---------------------------------------------------------------------------------------
    def proposal(self, weights: dict[int, float]) -> Plan:
        """The plan this member would propose now: the current epoch, its members, `weights` (the
        detector's speeds as last read; {} means equal). No round trip unless the epoch is new."""
        e = self.epoch()
        return Plan(e, self.members(e), dict(weights))

    def agree_plan(self, step: int, mine: Plan) -> Plan:
        """Compare-and-set `mine` as the plan of `step`; returns the plan that won, ours or the stored one."""
        value = json.dumps({"epoch": mine.epoch, "members": list(mine.members), "weights": mine.weights})
        won = json.loads(self.store.compare_set(f"plan/{step}", "", value))
        return Plan(won["epoch"], tuple(won["members"]), {int(k): v for k, v in won["weights"].items()})

    def plan(self, step: int) -> Plan:
        """The step's plan in two round trips (weights read now): for callers without a sidecar."""
        weights = {int(k): v for k, v in json.loads(self.store.get("weights")).items()}
        return self.agree_plan(step, self.proposal(weights))

    def publish(self, step: int, epoch: int, held: tuple[int, ...], timings: list[tuple[int, int, float]]) -> int:
        """Say the all-reduce of (step, epoch) succeeded here; returns how many members have said so."""
        record = {"held": list(held), "timings": timings}
        self.store.set(f"done/{step}/{epoch}/{self.me}", json.dumps(record))
        return self.store.add(f"ndone/{step}/{epoch}", 1)

    def held(self, step: int, epoch: int, members: tuple[int, ...]) -> dict[int, list[int]]:
        values = self.store.multi_get([f"done/{step}/{epoch}/{m}" for m in members])
        return {m: json.loads(v)["held"] for m, v in zip(members, values)}

    def propose(self, step: int, epoch: int, outcome: str) -> tuple[str, int]:
        """Compare-and-set the decision of (step, epoch); returns the winning (outcome, proposer)."""
        won = self.store.compare_set(f"decision/{step}/{epoch}", "", f"{outcome}:{self.me}").decode()
        kind, _, who = won.partition(":")
        return kind, int(who)

    def decision(self, step: int, epoch: int) -> str | None:
        """The decided outcome of (step, epoch), or None: one round trip. A compare_set against a value
        no decision can hold returns that value when the key is missing (and writes nothing)."""
        value = self.store.compare_set(f"decision/{step}/{epoch}", _MISSING, _MISSING)
        return None if value == _MISSING.encode() else value.decode().partition(":")[0]

    def await_decision(self, step: int, epoch: int, timeout: datetime.timedelta) -> str:
        """Block (in the store, no polling) until (step, epoch) is decided; returns the outcome."""
        key = f"decision/{step}/{epoch}"
        self.store.wait([key], timeout)
        return self.store.get(key).decode().partition(":")[0]

    def wait_for(self, step: int, epoch: int, want_decision: bool, timeout_s: float,
                 decided: Future | None = None) -> tuple[str, object]:
        """Wait until (step, epoch) is decided (if `want_decision`) or the epoch moves past `epoch`.

        Returns ("decided", outcome) or ("moved", chain); a decision wins when both hold. Raises
        TimeoutError after `timeout_s`. With the watch and `decided` (a sidecar's `decision` future)
        both wake-ups are pushed; otherwise the decision is polled (one round trip), every 0.2 ms at
        first, backing off to 2 ms.
        """
        deadline, pause = time.monotonic() + timeout_s, 0.0002
        if want_decision and decided is not None and self.watch is not None:
            decided.add_done_callback(lambda _: self.watch.poke())
            self.watch.wait_until(lambda: decided.done() or self.watch.current > epoch, timeout_s)
            if decided.done() and decided.exception() is None:
                return "decided", decided.result()
            # moved, timed out, or the sidecar's wait failed: the polling below settles it
        while time.monotonic() < deadline:
            if want_decision:
                outcome = self.decision(step, epoch)
                if outcome is not None:
                    return "decided", outcome
            if self.epoch() > epoch:
                return "moved", self.chain_after(epoch)
            if self.watch and not want_decision:
                self.watch.wait_until(lambda: self.watch.current > epoch, max(0.0, deadline - time.monotonic()))
            else:
                time.sleep(pause)
            pause = min(pause * 1.5, 0.002)
        raise TimeoutError(f"step {step}: nothing changed in epoch {epoch} for {timeout_s:.0f} s")

    def first_to_apply(self, step: int) -> bool:
        first = self.store.add(f"applied/{step}", 1) == 1
        if first:
            self.store.set("last_commit", str(step))
        return first

    def finish(self) -> None:
        """Call once after the last step: the coordinator stops judging this member's liveness."""
        self.store.set(f"finished/{self.me}", "1")

    def failed(self) -> dict | None:
        return json.loads(self.store.get("failed")) if self.store.check(["failed"]) else None
