"""The event log: one JSON object a line in `RUN_DIR/events.jsonl`, written by every process of a run.

Owns: the record format, appending safely from many processes, and reading a log back.
Does not own: what to do about an event (policy), or summaries, live figures and plots (observe/runs.py,
observe/view.py, observe/plot.py).

This docstring is the schema, for third-party readers too. Schema version: `SCHEMA_VERSION` below, carried
by the first record of a log (`run_start`, field "schema"; logs written before versioning have none:
version 0, the same fields minus `snapshot`). A version only grows when a field changes meaning or
goes away; new kinds and new fields may appear within a version, so readers should ignore what they
do not know. Every record has "event" (its kind), "t" (wall-clock seconds, time.time()) and "who" (the
writing process: launcher, coordinator, replica<N>, agent<N>); most have "replica". The simulator writes
the same kinds with "t" on its virtual clock, so readers serve real and simulated runs alike. Kinds and
their fields:

  run_start      schema, replicas, steps, microbatches, exact, seed, faults, recovery, run_id, group_size
                 (ranks per replica group), coordinator (its address: a standalone coordinator's run only)
  A replica group of several ranks: every rank writes its own compute, reduce, applied and fenced
  records, with `rank` (absent: rank 0); `applied`'s state_digest is of its shard; `param_digest` in
  the step record is then sha256 over the ranks' shard digests (hex, rank order).
  worker_start   replica, rank, group_size, node, pid, torchrun (started by torchrun), restart (its count),
                 forked ("server": the launcher's fork server; "agent": forkrun's torchrun agent; "": exec'd)
  parallelized   replica, rank, fsdp_units (module paths of its FSDP2 units, "" the root), tp_sharded
                 (parameters split over TP), stage (pipeline stage, null without), stack (the keys of
                 the plan's layers container it holds, null without one), inputs (the plan's extra inputs)
                 (each rank of a group of several ranks, once built at its full plan: what its plan, or a
                 user's parallelize function, applied; runtime/parallel/parallelize.py: describe)
  step           step, loss, microbatches, replicas (replica groups of the commit epoch), ranks (their
                 ranks in all, each as it ran: a re-formed group's fewer), epoch, tokens, t,
                 param_digest (XXH3-128 of all float32 params after the optimizer step, fixed order),
                 owners ({replica: [microbatch, ...]} reduced in the commit epoch), attempts, step_time
  applied        step, replica, state_digest, waited  (each member after its optimizer step; XXH3-128;
                 waited: s spent waiting for a peer's decision or a new epoch in the step)
  compute        step, replica, epoch, microbatch, seconds, wall, tokens, sumsq   (one per microbatch;
                 seconds: device time (runtime/trainer/devicetime.py), this rank's own: a pipeline
                 stage's is its schedule's time shared out by tokens, so each stage (rank) logs its own
                 and the group's time for a microbatch is the maximum over its ranks' records; wall: wall
                 time, shared out likewise. The detector takes that maximum from the ranks' done keys
                 in the store, coordinator/slowness.py: group_timings, not from these records)
  reduce         step, replica, epoch, seconds, ok, wait; microbatches (ok: the ones it reduced)
  decision       step, epoch, outcome ("commit" | "retry"), replica (who proposed the winning value)
  fault          kind, replica, step, phase, ...      (an injected fault, written just before it fires)
  member_dead    replica, epoch (the new epoch without it), reason (for a group of several ranks "rank J: ...";
                 "rank J: evicted, slow (speed v)": the scheduler shrank the group around its slow rank J)
  join           replica, epoch (the new epoch with it), restart   (a restarted or new group admitted)
  join_refused   replica, error                       (a restarted or new group whose config or model
                                                       differs from the run's: nothing loaded, it exits 2)
  heal           replica (the joiner), donor, step (the state after it), bytes, seconds (all, the
                 two-rank group's rendezvous included), transfer (s of the broadcasts alone), side ("donor"
                 | "joiner"), held (donor: s its step was held up), rank   (one per rank and side; the
                 joiner's says its digest matched)
  heal_failed    replica, donor, step, error          (the joiner never came or died mid-transfer)
                 A heal with why="corruption" is the state agreement check's (trainer/agreement.py): the
                 corrupted member (side "joiner", digest_ok) pulls a peer's state in place, no restart.
  flip           replica, step, target (grad | param | optimizer), tensor, element, bit (index), named
                 (bit= as given), before, after (repr of the values), microbatch (grad), state (optimizer:
                 its key), rank   (an injected bit flip: faultspec `flip`)
  corruption     step, replica, donor, found, agreed (digests), groups (how many compared), rank   (the
                 state check found this member's state differing from the majority's after `step`);
                 healed=false, groups (a list), digests, why="no majority": a split nobody can settle
  state_check    step, replica, ok=null, why      (a check skipped: a member was lost meanwhile)
                 corruption with kind="gradient": step, replica (the owner, who writes it), microbatch, wrong
                 (groups outvoted), digests ({group: digest}), split; found, agreed where the owner is wrong
                 (a recomputed microbatch's gradient compared: trainer/recompute.py)
  gradient_check step, replica, microbatch, ok=null, why   (a comparison skipped: a checker was lost)
  nonfinite      step, replica, microbatches, loss, rank   (its own gradient sum or loss was NaN or inf: it
                 leaves the step and the run)
  evicted        step, replica, why ("corrupted"), times, rank   (found wrong detect.evict_after times)
  epoch          epoch, members, reform (only when the same members re-form a group that broke with
                 nobody dead: the reason a member gave), admitted (groups that joined in it)
  recovery       step, replica, from_epoch, to_epoch, redo (microbatches this replica took over)
  replan         step, replica, proposed, agreed, why (the step's work was dropped and redone: "another
                 plan won" over our own, or "previous step retried" after we had stepped ahead of it)
  undone         step, replica, epoch                 (optimizer stepped ahead of a retry decision: undone)
  group_plan     step, replica, why, group, decision (drop|keep|reweight|repartition|shrink|grow), plan
                 ("tp8 pp3 [27,27,26]"; null: dropped), teams (ranks per stage), predicted_step_seconds,
                 replan_seconds, moved_bytes, horizon_steps, options (every candidate: kind, plan, weight,
                 step_seconds, replan_seconds, moved_bytes, amortised_seconds)   (policy/replan_scheduler.py's
                 decision for a group that lost or regained ranks or whose rank turned slow; the
                 simulator applies it). The coordinator writes it too when a group turns Slow or Healthy
                 again (runtime/coordinator/replan.py), adding speed, located (the ranks found slow
                 against the same rank of the peer groups, policy/locating.py; [] where none), rank_speeds
                 (rank -> that ratio; {} without per-rank times), per_microbatch_seconds, cost_source
                 (predictor|measured median), applied (the option it executed: keep|reweight|shrink|
                 drop), applied_weight, not_executable (kind -> why);
                 for a group running shrunk also shrunk (true) and device_speed (its speed over its
                 plan's weight: below 1, its device is slower than its plan was expected to run);
  group_plan_measured  step (the last measured), replica, why, applied (shrink|grow|keep|reweight), plan,
                 decided_step, steps, then each prediction beside its measurement: predicted_/measured_
                 replan_seconds, predicted_moved_bytes / moved_bytes, predicted_/measured_weight,
                 predicted_/measured_step_seconds; healed_ranks; quota_weight (a shrink under
                 run.quotas=speed: the weight its quotas follow from then on, its measured speed; null:
                 unchanged)   (the coordinator, once a re-planned group has committed its first 3 steps on
                 the new plan, or 3 steps after a keep or reweight decision: nothing moved, 0 bytes, the
                 re-plan time null; not for a drop; what each figure counts: runtime/coordinator/replan_measure.py)
  fenced         replica, step, reason                (a zombie that woke up and left)
  exit           replica, code                        (the launcher saw a worker process end)
  run_failed     reason, last_committed_step
  coordinator_leads  pid, host, waited (s it stood by), takeover (true: it took over a running
                 membership), previous (the identity of the leader it replaced, if it saw one)   (etcd store)
  coordinator_deposed  pid                            (a write found another coordinator leading: it ends)
  run_end        ok, steps_committed, seconds
  worker_error   replica, error                       (an exception in a trainer: the run fails)
  group_broken   replica, rank, error                 (a rank's group process group failed under it: a
                                                       peer rank died; the group leaves, the run goes on)
  survivor_left  replica, rank, why                   (replan: its group's shrunk plan runs on other
                                                       survivors; this one leaves)
  regroup        replica, rank, stages, shards, seconds  (replan: a survivor took stage `rank` of its group's
                                                       shrunk plan of `stages` stages, holding the full
                                                       plan's shard indices `shards`; `seconds` to replace
                                                       the broken process group with the plan's ranks')
  woke           replica, step, phase                 (a stopped process continued; it will fence)
  verdict        step, replica, old, new, speed, score, noise (fail-slow detector: healthy/suspect/slow;
                 noise: the log-sd of the replica's step score its thresholds took, policy/noise.py)
  noise          step, fleet (device class -> log-sd), replicas (replica -> log-sd)   (the detector's
                 measured noise: when it first shows and each time a class's moved by 20%)
  regime         step, device_class, factor, moved, replicas   (every cost moved: predictor rescaled)
  restart        generation, reason, source           (whole-job restart; source memory|disk|scratch)
                 resumed (true: `unbroken resume` continued the run after its launcher ended)
  restored       replica, source, step, seconds, param_digest  (digest of the state just loaded)
  restore_failed replica, source, step, error         (that source was refused; the next is tried)
  rebuilt        nodes, step, parity                  (a lost node's shards rebuilt from parity)
  rebuild_failed nodes, error
  snapshot       replica, share, step                 (an in-memory snapshot's copy began; it commits on
                 its own thread, or the older snapshot stays)
  snapshot_skipped replica, share, step               (both slots busy: training is never stalled)
  worker_done    replica                              (a trainer finished its last step)
  torn           replica, step                        (at a restart: a snapshot slot left mid-copy by its
                                                       dead writer; never committed, never restored)
  shard_rejected replica, step, rebuilt               (a restore read a shard that failed its checksum;
                                                       rebuilt: repaired from parity and verified)
Simulated runs (sim/) add:
  steps          an aggregate of many committed steps: from_step, to_step, tokens, total_tokens, ...
  rollback       to_step, from_step, tokens, total_tokens, reason   (work lost to a restart)
  slow           replica, factor, until, kind         (a fail-slow episode starts or ends)
  quotas         step, weights                         (speed-weighted quotas changed; the coordinator
                                                       logs it too, at the step its detector reached)
  group_plan_skipped step, replica, decision | why     (a decision the simulator does not apply; the
                                                       coordinator: why it could not price one)
  restart        seconds, reason, members             (simulated downtime of a restart)
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError


SCHEMA_VERSION = 1


class EventLog:
    """Append-only JSON-lines writer, safe across processes.

    Each record goes out in a single `os.write` on an O_APPEND descriptor, so records from different
    processes never interleave inside a line. Open one per process; `emit` may be called from any thread.
    """

    def __init__(self, path: str | os.PathLike[str], **common: Any):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._common = common

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": fields.pop("t", time.time()), **self._common, **fields}
        if event == "run_start":
            record["schema"] = SCHEMA_VERSION
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        return record

    def close(self) -> None:
        os.close(self._fd)


class CorruptLog(ConfigError):
    """A line of the log that does not parse and is not a torn last line: the log cannot be trusted. A
    ConfigError: a command given such a log says so in one line and exits 2, as for any bad input."""


@dataclass(frozen=True)
class LogRead:
    """A log read back: its complete records, the torn last line a killed writer left (or None), and
    the numbers of other lines that did not parse (only when read with strict=False)."""
    records: list[dict[str, Any]]
    torn: str | None
    corrupt: tuple[int, ...] = ()


def read_log(path: str | os.PathLike[str], strict: bool = True) -> LogRead:
    """Every record of a log (a run directory or its events.jsonl). Only the last line may fail to
    parse, and only if it lacks its newline (a writer killed mid-record); it is returned as `torn`.
    Raises CorruptLog naming the first other line that does not parse (a JSON object a line, or
    nothing counts), FileNotFoundError if there is no log. With strict=False (a summary that must be
    written whatever happened) such lines are skipped and their numbers returned in `corrupt`."""
    p = Path(path)
    if p.is_dir():
        p = p / "events.jsonl"
    records: list[dict[str, Any]] = []
    torn = None
    corrupt: list[int] = []
    with open(p, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):
                torn = line  # the last line (only it can lack a newline)
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or "event" not in record:
                if strict:
                    raise CorruptLog(f"{p}: line {n} is not an event record: {line.strip()[:60]!r}")
                corrupt.append(n)
                continue
            records.append(record)
    return LogRead(records, torn, tuple(corrupt))


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of a log; a torn last line from a killed writer is skipped (read_log
    reports it). Raises CorruptLog for any other line that does not parse."""
    return read_log(path).records


def has_step_record(path: str | os.PathLike[str], step: int, chunk: int = 1 << 20) -> bool:
    """Whether the log's current generation (since its last `restart` record) holds the record of `step`,
    read back from the end: for a survivor about to write the record of a writer that died after its
    record was out but before the store said so. Assumes, as the writers guarantee, that `step` is the
    newest step that can have a record: the scan stops at the first `step` or `restart` record."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            lines = (f.read(end - start) + tail).split(b"\n")
            tail, end = (lines.pop(0) if start else b""), start  # a line cut by the chunk's start: next time
            for line in reversed(lines):
                if line.startswith(b'{"event":"restart"'):
                    return False
                if line.startswith(b'{"event":"step"'):
                    try:
                        return json.loads(line)["step"] == step
                    except (ValueError, KeyError):
                        continue  # a torn last line
        return False


def steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Committed step records by step number, the last copy of each (a step redone after a whole-job
    restart has one copy per generation; `step_copies` keeps them all)."""
    return {r["step"]: r for r in records if r["event"] == "step"}


def step_copies(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Every record of each committed step, in log order: one, or one per generation that ran it."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["event"] == "step" and isinstance(r.get("step"), int):
            out.setdefault(r["step"], []).append(r)
    return out
