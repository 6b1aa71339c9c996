"""A member's store work that needs no place on the step's critical path, on a thread of its own.

Owns: one background thread with its own store client (clients are not thread-safe) that, for the step
loop, (1) compare-and-sets the plan of a generation's first step while the member already computes
under its own proposal (every later step's plan comes with the commit of the step before), (2)
publishes a step's done record and count while the member steps its optimizer ahead, and if it was
the last to publish compare-and-sets the commit decision, carrying the next step's plan, (3) after a
committed step whose commit this member proposed, writes its record (reads the commit epoch's owners;
the parameters' digests are those the member took for its `applied` records: the sidecar never reads
the parameters), and refreshes the quota weights the next proposal carries when the coordinator
changed them; (4) after a recovery, writes the record of the step before if its writer died with it
unwritten (or only says so in the store, if the writer died after its record reached the log: the
log is read back for it).

Every committed step gets its record, written by the member that proposed its commit (the decision
names it: no member claims anything). A member publishes a step (lets it commit) only after the
record it writes of the step before is out (`wait_records` before publishing), so a writer that
dies with its record unwritten leaves the next step uncommitted in its epoch; the survivors recover
in that step, their parameters still those after the unrecorded one, and one of them writes it
(`recover`). After the last step, a survivor writes it once the writer is declared dead (`finish`).
(Every member compare-and-set a claim on each step's record before: 4 of the ~26 store requests of
a 4-replica step, and the plan's compare-and-set by every member 4 more.)
Does not own: what a plan or a decision means (policy.recovery, trainer/membership.py), or the step record's
fields (events.py).

Why: on a machine whose cores the replicas share, a member that blocks on a store round trip while its
peers compute waits a scheduler slice (~1-2 ms measured) to run again; those waits and one member's
sha256 (holding every peer at the next all-reduce) were ~5% of a small model's step. (The record once
hashed the parameters here too, a second hash of what `applied` had just hashed: on a GPU a second
host copy of the shard each step. It takes the member's digests now.)
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from unbroken.events import EventLog, has_step_record
from unbroken.runtime.trainer.membership import Coordination, Plan


class Sidecar:
    """Call `plan` at the start of a generation's first step, `publish` for a step stepped ahead, `record`
    after applying, `recover` on a recovery, and `wait_records` before the parameters change again,
    before publishing the next step and before leaving. Jobs run in that order, one at a time, on one
    thread; none reads the parameters (`record` is given their digests).
    """

    def __init__(self, coord: Coordination, log: EventLog, group_size: int = 1, wait_s: float = 60.0,
                 shards: tuple[int, ...] | None = None):
        self.coord, self.log = coord, log
        # A group of G ranks: each holds a shard, so the record's digest (written by rank 0 of the
        # writer's group) is the sha256 of its ranks' shard digests in rank order, which ranks 1..G-1
        # post after every step (`coord.post_shard`); identical in every group (they hold the same state).
        self.group_size, self.wait_s = group_size, wait_s
        # The shard indices this rank holds, its loss's own first (default: its rank's). A shrunk group's
        # rank holds several (standin.py): their digests are its own to take (or to post, rank j > 0 of a
        # re-formed group), the others' with loss share 0 (its loss sits in its own slot).
        self.shards = shards or (coord.rank,)
        self._weights = coord.weights()  # (version, weights)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sidecar")
        self._jobs: list[Future] = []  # submitted and not seen done: what `close` waits for
        self._records: Future | None = None
        self._last: tuple[int, int, tuple[int, ...], int, dict] | None = None  # the last `record` call's arguments
        self._digests: dict[int, str] = {}  # shard index -> digest, of the step `record` was given last

    def _submit(self, job: Callable, *args) -> Future:
        self._jobs = [f for f in self._jobs if not f.done()]
        self._jobs.append(self._pool.submit(job, *args))
        return self._jobs[-1]

    def close(self, timeout_s: float) -> bool:
        """Call when the trainer is let go before the process ends (a group's survivor re-forming):
        cancels the queued jobs and waits up to `timeout_s` for the running one (its store requests and
        this sidecar, which its bound method holds). True when no job runs any more (the thread ended); no
        job may be submitted after. Calling it again waits again, for the same jobs."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        # not the cancelled ones: `wait` counts a future cancelled off the queue (never notified) as running
        if wait([f for f in self._jobs if not f.done()], timeout_s).not_done:
            return False
        self._pool.shutdown(wait=True)  # its thread, past its last job's result, lets the job go and ends
        return True

    def plan(self, step: int, mine: Plan) -> Future:
        """Compare-and-set `mine` as the plan of `step`; the future holds the plan that won."""
        return self._submit(self.coord.agree_plan, step, mine)

    def publish(self, step: int, epoch: int, held: tuple[int, ...], timings: list, staged: bool, members: int,
                next_plan: Plan, watch: Callable[[int, int], None]) -> Future:
        """Publish done(step, epoch) off the step's path (commit pipelining: the optimizer steps
        meanwhile). Writes the done record unless `staged`, counts it; if this member was the last of
        `members` to publish, compare-and-sets a commit carrying `next_plan`, else asks `watch`
        (thread-safe) for the decision. The future holds (count, the Decision that won, or None).
        Runs after the record job queued before it, and not at all if that one failed: a member
        publishes only after its record of the step before is out."""
        before = self._records
        return self._submit(self._publish, before, step, epoch, held, timings, staged, members, next_plan,
                                 watch)

    def _publish(self, before: Future | None, step: int, epoch: int, held: tuple[int, ...], timings: list,
                 staged: bool, members: int, next_plan: Plan, watch: Callable[[int, int], None]):
        if before is not None:
            before.result()  # done (jobs run in order); re-raises its error
        count = self.coord.publish(step, epoch, held, timings, staged)
        if count >= members:
            return count, self.coord.propose(step, epoch, "commit", self._freshen(next_plan))
        watch(step, epoch)
        return count, None

    def record(self, step: int, epoch: int, members: tuple[int, ...], writer: int, record: dict,
               digests: dict[int, str]) -> None:
        """Queue the bookkeeping of committed `step`, whose record `writer` (the proposer of its
        commit) writes; `record` holds the step record's other fields, `digests` the parameters'
        digests after the step's optimizer step (accumulator.param_digest), one for each shard index
        this rank holds. Raises KeyError if one is missing."""
        self.wait_records()
        self._digests = {j: digests[j] for j in self.shards}
        record = {**record, "t": time.time()}  # the commit's time, not the job's
        self._last = (step, epoch, members, writer, record)
        write = writer == self.coord.me and self.coord.rank == 0
        if write or self.coord.rank or self.coord.weights_moved(self._weights):
            self._records = self._submit(self._record, write or self.coord.rank > 0, *self._last)

    def recover(self, step: int, survivors: tuple[int, ...]) -> None:
        """Call on a recovery in step `step + 1`, before the parameters change (its optimizer step
        waits for this job): if `step`'s record is unwritten and its writer is not among the new
        epoch's members, `survivors`, one survivor writes it. A no-op unless we applied `step` last."""
        self.wait_records()
        if self.coord.rank == 0 and self._last is not None and self._last[0] == step and self._last[3] not in survivors:
            self._records = self._submit(self._rewrite, *self._last)

    def wait_records(self) -> None:
        """Block until the last step's bookkeeping is done; re-raises its error."""
        if self._records is not None:
            pending, self._records = self._records, None
            pending.result()

    def finish(self, step: int, timeout_s: float) -> None:
        """Call once after the last step, `step`: waits for its record. If its writer is declared
        dead with it unwritten, one survivor writes it (no next step can stand in for a recovery).
        Gives up after `timeout_s` of a live writer not writing it; the launcher then reports
        the step as not committed."""
        self.wait_records()
        if self._last is None or self._last[0] != step or self._last[3] == self.coord.me or self.coord.rank:
            return
        deadline = time.monotonic() + timeout_s
        while not self.coord.recorded(step) and time.monotonic() < deadline:
            if self.coord.is_dead(self._last[3]):
                self._rewrite(*self._last)
                return
            time.sleep(0.05)

    def digest(self, step: int, loss: float) -> tuple[str, float]:
        """(parameter digest, loss) of `step`, the step `record` was given last, for its record, given
        this rank's: the group's (rank 0), or this shard's, posted for rank 0 (rank j > 0). A group's loss
        is the sum of its ranks' shares, each already reduced across groups: summed here, off the step's
        path, where an all-reduce inside the group cost every rank ~5 ms a step (measured, 2 x 2 ranks
        on 2 cores). Rank 0 waits up to wait_s for its ranks' posts; raises on a timeout."""
        own = self._digests[self.shards[0]]
        if self.group_size == 1:
            return own, loss
        mine = {j: (self._digests[j], loss if n == 0 else 0.0) for n, j in enumerate(self.shards)}
        if self.coord.rank:
            for j, (d, x) in mine.items():
                self.coord.post_shard(step, d, x, rank=j)
            return own, loss
        missing = [j for j in range(self.group_size) if j not in mine]
        parts = {**mine, **dict(zip(missing, self.coord.shards(step, missing, self.wait_s)))}
        return (hashlib.sha256("".join(parts[j][0] for j in range(self.group_size)).encode()).hexdigest(),
                sum(x for _, x in parts.values()))

    def _record(self, takes_part: bool, step: int, epoch: int, members: tuple[int, ...], writer: int,
                record: dict) -> None:
        # takes_part: this rank writes the record (rank 0 of the writer's group) or posts its digest for it
        if takes_part and self.coord.rank:
            self.digest(step, record["loss"])  # posted for the group's rank 0
        elif takes_part:
            self._write(step, epoch, members, record, *self.digest(step, record["loss"]))
        self._weights = self.coord.weights(self._weights)

    def _rewrite(self, step: int, epoch: int, members: tuple[int, ...], writer: int, record: dict) -> None:
        if not self.coord.recorded(step) and self.coord.reclaim_record(step):
            if has_step_record(self.log.path, step):  # the writer died between its record and the store's
                self.coord.mark_recorded(step)        # mark of it (a store round trip): one record only
                return
            self._write(step, epoch, members, record, *self.digest(step, record["loss"]))

    def _write(self, step: int, epoch: int, members: tuple[int, ...], record: dict, digest: str,
               loss: float) -> None:
        done = self.coord.done_records(step, epoch, members)
        # A writer declared dead before its record is out leaves it to the survivor that recovers
        # (`recover`, which reads the log after the verdict): a process that outlived the verdict (a
        # group's survivor going on shrunk, a zombie) would otherwise write the same step again.
        if self.coord.is_dead():
            return
        # the ranks that took part: each member's own count (a group re-formed on fewer ranks than its
        # plan's, or a one-rank stand-in, has fewer than `parallel.group_size`)
        self.log.emit("step", **{**record, "loss": loss}, epoch=epoch, members=list(members), replicas=len(members),
                      ranks=sum(d.get("ranks", 1) for d in done.values()),
                      owners={str(m): d["held"] for m, d in done.items()}, param_digest=digest)
        self.coord.mark_recorded(step)

    def fresh(self, plan: Plan) -> Plan:
        """`plan` with the newest quota weights, for the commit proposal made now (the step's
        last publisher, not stepping ahead): on this thread, and a store read only when the coordinator
        published new ones since the last. Call after `wait_records`."""
        if not self.coord.weights_moved(self._weights):
            return plan
        return self._submit(self._freshen, plan).result()

    def _freshen(self, plan: Plan) -> Plan:
        # Weights read after the last commit (`_record`) miss a verdict the coordinator reached on that
        # very step, and this proposal plans the step after the next: re-read here, a Slow replica's
        # quota moves one step sooner (2 steps after its verdict's step, not 3; the plan of the step
        # in flight came with the last commit).
        self._weights = self.coord.weights(self._weights)
        return Plan(plan.epoch, plan.members, dict(self._weights[1]))

    @property
    def weights(self) -> dict[int, float]:
        """The quota weights as last read (after the last committed step): the next proposal's."""
        return self._weights[1]

