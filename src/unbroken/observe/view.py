"""What a run is doing, folded from its event records: the one model behind /metrics, TensorBoard,
`unbroken status` and `unbroken report`.

Owns: the fold (`RunView.feed`, records in log order, incrementally: a tail of a live log or a whole
finished one), the definitions of the derived figures (recovery incidents and their seconds lost, their
cause, committed tokens counted once per step, tokens/s) and the JSON status snapshot.
Does not own: reading files or the store, serving, rendering or plotting. No torch, no clock: times
come from the records ("t", seconds since the epoch; virtual seconds in simulated logs).

A recovery *incident* is one step s interrupted in epoch e and finished in a later epoch (all of its
`recovery` records, one per survivor, count once), or a whole-job restart. Its seconds lost run from the
first sign (the injected `fault` that took the dead replica, or else the `member_dead` verdict) to the
first `step` record of s (for a restart: to the first commit past the step it resumed from; an in-step
recovery that a restart cuts short ends at the restart, and the restart's seconds start there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RECENT = 8  # faults and incidents kept for the status screen
STOPPING = ("kill", "hang", "node", "crash-all", "tear")  # fault kinds that take a replica out of a step


def cause_of(reason: str) -> str:
    """A short label for a `member_dead` reason (coordinator / policy.membership wording)."""
    if reason.startswith("process exited"):
        return "exit"
    if reason.startswith("no heartbeat"):
        return "heartbeat"
    if reason.startswith("stuck"):
        return "stuck"
    if reason.startswith(("evicted: state corrupted", "non-finite")):  # runtime/trainer/agreement.py
        return "corruption"
    return "other"


@dataclass
class Incident:
    step: int  # the step that was interrupted (restart: the first step redone)
    start: float  # s (record clock): the first sign of the failure
    cause: str  # exit | heartbeat | stuck | reform | restart-<source> | other
    from_epoch: int
    to_epoch: int
    redo: set[int] = field(default_factory=set)  # microbatches recomputed by survivors
    end: float | None = None  # s: the step's commit; None while still recovering
    superseded: bool = False  # a whole-job restart took over before the step committed (end: the restart)

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "start": self.start, "cause": self.cause, "from_epoch": self.from_epoch,
                "to_epoch": self.to_epoch, "redone": len(self.redo), "seconds": self.seconds,
                "superseded": self.superseded}


@dataclass
class RunView:
    """Call `feed(records)` with records in log order; read the attributes or `status()` between feeds.

    With `history=False` (a live exporter on a job of millions of steps) memory stays O(failures): step
    records below the frontier and all but the last 64 points of the tokens curve are dropped."""
    history: bool = True  # keep every step record and the whole tokens curve (report)
    replicas: int = 0
    steps_planned: int = 0
    microbatches: int = 0
    run_id: str = ""
    schema: int = 0  # events.py SCHEMA_VERSION of the log (0: written before versioning)
    t0: float | None = None
    t_last: float | None = None
    ended: dict[str, Any] | None = None  # the run_end record
    failed: str | None = None
    generation: int = 0
    epoch: int = 0
    members: list[int] = field(default_factory=list)
    live: list[tuple[float, int]] = field(default_factory=list)  # (t, live replica groups) per change
    committed: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> its first step record
    frontier: int = -1  # highest step with every step below committed
    tokens: int = 0  # committed tokens, each step once
    tokens_curve: list[tuple[float, int]] = field(default_factory=list)  # (t, tokens) per frontier move
    step_records: int = 0
    steps_redone: int = 0  # step records of a step committed before (after a restart)
    retries: dict[str, int] = field(default_factory=dict)  # retry decisions by cause
    restarts: dict[str, int] = field(default_factory=dict)  # whole-job restarts by restore source
    incidents: list[Incident] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # every injected fault record
    dead: dict[int, str] = field(default_factory=dict)  # replica -> reason (this generation)
    health: dict[int, str] = field(default_factory=dict)  # detector verdict per replica
    speed: dict[int, float] = field(default_factory=dict)  # detector speed estimate per replica (1 = typical)
    verdicts: dict[str, int] = field(default_factory=dict)  # verdict changes by new state
    noise: dict[int, float] = field(default_factory=dict)  # detector's measured noise per replica (last `noise`)
    suspects: dict[str, int] = field(default_factory=dict)  # "replica[.rank]" -> times found computing wrong values
    evicted: dict[str, int] = field(default_factory=dict)  # "replica[.rank]" -> step it was evicted at (corrupted)
    snapshot: dict[str, Any] | None = None  # the latest `snapshot` record
    snapshots_skipped: int = 0
    checkpoint_step: int | None = None  # set by the reader (from disk), not from events
    evals: dict[int, float] = field(default_factory=dict)  # step -> validation loss of its parameters
    unreadable: int = 0  # records skipped: a field the fold needs is missing or of the wrong type
    _epoch_cause: dict[int, str] = field(default_factory=dict)
    _open: dict[tuple[int, int], Incident] = field(default_factory=dict)
    _last_fault: dict[int | None, dict[str, Any]] = field(default_factory=dict)  # replica -> pending fault
    _starts: dict[int, float] = field(default_factory=dict)  # epoch -> first sign of what ended the one before

    def feed(self, records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """Fold records in; returns what a live writer shows per record: ("step", the step record) the
        first time a step commits, ("eval", record) the first time a step's parameters are evaluated,
        ("fault", record), ("incident", Incident.as_dict()) once one ends."""
        out: list[tuple[str, dict[str, Any]]] = []
        for r in records:
            try:
                handler = getattr(self, "_on_" + r["event"].replace("-", "_"), None)
                self.t_last = r["t"] if self.t_last is None else max(self.t_last, r["t"])
                if handler is not None:
                    out.extend(handler(r) or ())
            except (KeyError, TypeError, ValueError, AttributeError):
                self.unreadable += 1  # not of this schema (events.py): counted, never folded half-way
        return out

    def _on_run_start(self, r):
        self.schema = r.get("schema", 0)
        self.replicas, self.steps_planned = r.get("replicas", 0), r.get("steps", 0)
        self.microbatches, self.run_id, self.t0 = r.get("microbatches", 0), r.get("run_id", ""), r["t"]

    def _on_eval(self, r):
        """An `eval` record (runtime/trainer/evaluation.py): shown once per step (a whole-job restart that
        evaluates the same step again gives the same value)."""
        if r["step"] not in self.evals:
            self.evals[r["step"]] = float(r["loss"])
            return [("eval", r)]
        return None

    def _on_run_end(self, r):
        self.ended = r

    def _on_run_failed(self, r):
        self.failed = r.get("reason")

    def _on_epoch(self, r):
        self.epoch, self.members = r["epoch"], list(r["members"])
        if r["epoch"] == 0:  # a (new) generation: every replica starts again
            self.dead = {}
            self.health = {k: h for k, h in self.health.items() if h != "dead"}
        if "reform" in r:
            self._epoch_cause[r["epoch"]] = "reform"
            self._starts.setdefault(r["epoch"], r["t"])
        self.live.append((r["t"], len(self.members)))

    def _on_member_dead(self, r):
        self.dead[r["replica"]] = r["reason"]
        self.health[r["replica"]] = "dead"
        self._epoch_cause.setdefault(r["epoch"], cause_of(r["reason"]))
        fault = self._last_fault.pop(r["replica"], None) or self._last_fault.get(None)
        start = min(r["t"], fault["t"]) if fault else r["t"]
        self._starts[r["epoch"]] = min(self._starts.get(r["epoch"], start), start)

    def _on_fault(self, r):
        self.faults.append(r)
        if r["kind"] in STOPPING:  # None: every replica, or a node's (crash-all, node)
            self._last_fault[r.get("replica")] = r
        return [("fault", r)]

    def _on_flip(self, r):  # an injected bit flip (bitflip.py): a fault, of kind "flip"
        return self._on_fault({**r, "kind": "flip", "phase": r["target"]})

    def _on_corruption(self, r):  # the state check's (a split names nobody: no "donor"), or a gradient's vote
        if r.get("kind") == "gradient":  # counted once: in the record of the device outvoted ("found")
            wrong = [str(r["replica"])] if "found" in r else []
        else:
            wrong = [f"{r['replica']}" + (f".{r['rank']}" if r.get("rank") else "")] if "donor" in r else []
        for device in wrong:
            self.suspects[device] = self.suspects.get(device, 0) + 1

    def _on_nonfinite(self, r):  # its own gradient sum or loss was NaN or inf
        device = f"{r['replica']}" + (f".{r['rank']}" if r.get("rank") else "")
        self.suspects[device] = self.suspects.get(device, 0) + 1

    def _on_evicted(self, r):
        self.evicted[f"{r['replica']}" + (f".{r['rank']}" if r.get("rank") else "")] = r["step"]

    def _on_decision(self, r):
        if r["outcome"] == "retry":
            cause = self._epoch_cause.get(r["epoch"] + 1, "other")
            self.retries[cause] = self.retries.get(cause, 0) + 1

    def _on_recovery(self, r):
        key = (r["step"], r["to_epoch"])
        inc = self._open.get(key)
        if inc is None:
            causes = {self._epoch_cause.get(e, "other") for e in range(r["from_epoch"] + 1, r["to_epoch"] + 1)}
            starts = [self._starts[e] for e in range(r["from_epoch"] + 1, r["to_epoch"] + 1) if e in self._starts]
            inc = Incident(r["step"], min(starts, default=r["t"]), "+".join(sorted(causes)), r["from_epoch"],
                           r["to_epoch"])
            self._open[key] = inc
            self.incidents.append(inc)
        inc.redo.update(r.get("redo", ()))

    def _on_restart(self, r):
        self.generation = r.get("generation", self.generation + 1)
        source = r.get("source", "")
        self.restarts[source] = self.restarts.get(source, 0) + 1
        signs = [f["t"] for f in self._last_fault.values()]
        self._last_fault.clear()
        # in-step recoveries the restart cut short end here (their loss so far is theirs); the restart's
        # loss starts here then, so no second is counted twice
        cut = [inc for key, inc in self._open.items() if key[1] >= 0]
        for inc in cut:
            inc.end, inc.superseded = r["t"], True
            del self._open[(inc.step, inc.to_epoch)]
        self._starts.clear()  # epochs count from 0 again in the new generation
        self._epoch_cause.clear()
        start = r["t"] if cut else min(signs, default=r["t"])
        inc = Incident(self.frontier + 1, start, f"restart-{source}", self.epoch, 0)
        self._open[(inc.step, -self.generation)] = inc  # closed by the frontier passing inc.step
        self.incidents.append(inc)

    def _on_step(self, r):
        s = r["step"]
        for key in ("t", "loss", "tokens", "microbatches", "owners"):  # what readers use: checked before any change
            r[key]
        self.step_records += 1
        if s in self.committed or s <= self.frontier:
            self.steps_redone += 1
            return None
        self.committed[s] = r
        out: list[tuple[str, dict[str, Any]]] = [("step", r)]
        while self.frontier + 1 in self.committed:
            self.frontier += 1
            self.tokens += self.committed[self.frontier]["tokens"]
            self.tokens_curve.append((r["t"], self.tokens))
        if not self.history:
            for old in [k for k in self.committed if k < self.frontier]:
                del self.committed[old]
            del self.tokens_curve[:-64]
        for key, inc in list(self._open.items()):
            if inc.step == s or (key[1] < 0 and self.frontier >= inc.step):
                inc.end = r["t"]
                del self._open[key]
                out.append(("incident", inc.as_dict()))
        return out

    def _on_verdict(self, r):
        self.verdicts[r["new"]] = self.verdicts.get(r["new"], 0) + 1
        if r["replica"] in self.dead:
            return  # the detector judges committed steps, behind the run: a verdict may follow a death
        self.health[r["replica"]] = r["new"]
        self.speed[r["replica"]] = r["speed"]

    def _on_noise(self, r):
        self.noise = {int(k): float(v) for k, v in r["replicas"].items()}

    def _on_snapshot(self, r):
        if self.snapshot is None or r["step"] >= self.snapshot["step"]:
            self.snapshot = r

    def _on_snapshot_skipped(self, r):
        self.snapshots_skipped += 1

    def tokens_per_second(self, window: int = 20) -> float | None:
        """Committed tokens per second over the last `window` frontier moves (None before two)."""
        pts = self.tokens_curve[-window - 1:]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def status(self, now: float | None = None) -> dict[str, Any]:
        """A JSON-able snapshot for `unbroken status`: figures as of `now` (default: the last record)."""
        now = self.t_last if now is None else now
        last = self.committed.get(self.frontier)
        replicas = {}
        for r in range(self.replicas):
            share = len(last["owners"].get(str(r), ())) / max(1, last["microbatches"]) if last else None
            replicas[str(r)] = {"member": r in self.members, "health": self.health.get(r, "healthy"),
                                "speed": self.speed.get(r), "dead": self.dead.get(r), "share": share}
        snap = self.snapshot
        return {
            "run_id": self.run_id, "t": now, "t0": self.t0, "finished": self.ended is not None,
            "ok": bool(self.ended and self.ended.get("ok")), "failed": self.failed or (
                self.ended.get("error") if self.ended else None),
            "step": self.frontier, "steps": self.steps_planned, "loss": last["loss"] if last else None,
            "eval_loss": self.evals[max(self.evals)] if self.evals else None,
            "eval_step": max(self.evals) if self.evals else None,
            "tokens": self.tokens, "tokens_per_second": self.tokens_per_second(), "epoch": self.epoch,
            "generation": self.generation, "members": self.members, "replicas": replicas,
            "faults": [{k: v for k, v in f.items() if k not in ("who", "pid", "seconds")}
                       for f in self.faults[-RECENT:]],
            "incidents": [i.as_dict() for i in self.incidents[-RECENT:]],
            "retries": self.retries, "restarts": self.restarts, "steps_redone": self.steps_redone,
            "snapshot": None if snap is None else {"step": snap["step"], "age_s": now - snap["t"] if now else None,
                                                   "steps_behind": self.frontier - snap["step"]},
            "snapshots_skipped": self.snapshots_skipped, "checkpoint_step": self.checkpoint_step,
            "unreadable_records": self.unreadable,
            "suspects": dict(self.suspects), "evicted": dict(self.evicted),
        }
