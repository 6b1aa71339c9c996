"""One replica's training loop: the step protocol of DESIGN.md, executing `policy.recovery` actions.

Owns: turning each action of the recovery state machine into real work (forward/backward into the local
accumulator, an all-reduce of a copy, store reads and compare-and-sets, the optimizer step) and each
outcome into the next event; the per-microbatch RNG; the events of this replica. Does not own: decisions
(policy), membership (coordinator), process start-up (worker.py, launch.py).

A step, read top to bottom (`train_step`, `run_plan`, `drive`):
  plan = our proposal (epoch, members, quota weights); the agreed plan comes with the step before's
                                               commit (a generation's first step: compare-and-set)
  policy says Compute(owned microbatches)   -> forward/backward each into this step's accumulator
  before anything leaves the process        -> settle the previous step (below); the agreed plan:
                                               adopt it, or redo the step under it
  policy says Reduce(epoch)                 -> all-reduce a copy in the epoch's group (or: epoch moved)
  policy says Publish / Propose / Await...  -> done count, compare-and-set decision, or wait for one
  on retry: policy replays the new membership, says Compute(what the dead owned) -> Reduce(new epoch)
  policy says Apply                         -> load reduced grads, optimizer step, digest, events;
                                               the commit's proposer writes the step record
                                               (on its sidecar)

Commit pipelining (run.step_ahead): where the policy says Publish, the publish (done count, and the
commit compare-and-set if we were last) goes to the sidecar and the optimizer steps at once, from a
copy of the state taken while the all-reduce ran (speculation.py); the next step starts computing
and settles this one's decision before anything of its own leaves the process (its reduce). Commit,
the usual case: the step's events and record are written then. Retry: the state is put back, this
step goes on from its own intact accumulator (two alternate between steps), and the next step starts
over. DDP's ranks part after the
all-reduce; without pipelining ours would wait for the last member to publish: a second
synchronisation point each step.
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.model.data import mix, seed_microbatch
from unbroken.policy import recovery as rec
from unbroken.policy.workload import loss_weight
from unbroken.runtime.collectives import CollectiveError, EpochGroup, EpochMoved
from unbroken.runtime.coordination import Coordination, Decision, Plan
from unbroken.runtime.devicetime import DeviceClock
from unbroken.runtime.faults import Injector
from unbroken.runtime.gradients import Accumulator, param_digest, state_digest, unique_parameters
from unbroken.runtime.heartbeat import Heartbeat
from unbroken.runtime.sidecar import Sidecar
from unbroken.runtime.speculation import Rollback, limit


@dataclass(frozen=True)
class Factories:
    """What a user brings. Each is called once per replica process, after the seed is set.

    model(cfg) -> nn.Module whose forward(x, y) returns the mean loss over counted targets;
    data(cfg) -> object with microbatch(step, i) -> (x, y, tokens, sumsq) and step_tokens(step, M);
    optimizer(params, cfg) -> torch.optim.Optimizer.
    """
    model: Callable[[Config], nn.Module]
    data: Callable[[Config], object]
    optimizer: Callable[[list[nn.Parameter], Config], torch.optim.Optimizer]


@dataclass
class StepWork:
    """What one step holds while it runs, and while its decision is pending: its accumulator (the
    step's local sum, kept for a retry), per-microbatch (tokens, sumsq, seconds), token count, times."""
    step: int
    acc: Accumulator
    tokens: int
    started: float  # time.time() at the step's start
    timings: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    waited: float = 0.0  # s spent waiting on peers' decisions or epochs (after any step ahead)
    stepped: float = 0.0  # time.time() after its optimizer step
    decision: Decision | None = None  # the last decision read of this step
    next_plan: Future = field(default_factory=Future)  # the next step's plan: its commit carries it


@dataclass(frozen=True)
class Pending:
    """A step whose optimizer stepped ahead of its decision: `action` is the Publish the policy asked
    for, run on the sidecar in `published` (sidecar.publish: the count and, if we were last, the
    commit we compare-and-set)."""
    work: StepWork
    state: rec.StepState
    action: rec.Publish
    published: Future


class Trainer:
    def __init__(self, cfg: Config, me: int, coord: Coordination, factories: Factories, log: EventLog,
                 heartbeat: Heartbeat, injector: Injector, sidecar: Coordination,
                 persistence: Callable | None = None):
        self.cfg, self.me, self.coord, self.log = cfg, me, coord, log
        self.hb, self.faults = heartbeat, injector
        torch.set_num_threads(cfg.run.threads)  # the same on every replica: kernels sum in the same order
        torch.manual_seed(cfg.run.seed)  # identical initial parameters on every replica
        self.model = factories.model(cfg)
        self.data = factories.data(cfg)
        self.params = unique_parameters(self.model)
        self.clock = DeviceClock(self.params[0].device, cfg.run.threads)
        self.optimizer = factories.optimizer(self.params, cfg)
        dtype = torch.float64 if cfg.run.exact else torch.float32
        self.accs = (Accumulator(self.params, dtype), Accumulator(self.params, dtype))  # steps alternate
        self.persist = persistence(self.model, self.optimizer) if persistence else None
        self.groups: dict[int, EpochGroup] = {}
        self.reduced: torch.Tensor | None = None  # the last all-reduce's result (`scratch`)
        self.scratch: torch.Tensor | None = None  # reused as the all-reduce's copy until one is abandoned
        self.wait_s = 4 * cfg.coord.collective_timeout
        self.reform_after = 2 * cfg.coord.heartbeat_timeout  # see wait()
        self.sidecar = Sidecar(sidecar, log, lambda: param_digest(self.params))
        # Snapshots and checkpoints of a step start once it is known committed; pipelined, that comes
        # after the next step's compute, so their copy would no longer overlap it: "auto" does not
        # pipeline with them (and a restore e2e test turned flaky with it: 2 of 4 runs against 0 of 4).
        mode = "off" if self.persist and cfg.run.step_ahead == "auto" else cfg.run.step_ahead
        self.rollback = Rollback(self.params, self.optimizer, limit(mode, self.params[0].device))
        self.ahead: tuple[int, int, float] | None = None  # (step, epoch, loss) stepped before its decision
        self.pending: Pending | None = None  # a step stepped ahead, its decision not yet read
        self.carried: dict[int, Future] = {}  # step -> its plan, once the step before commits
        self.work: StepWork  # the step whose actions run now

    def fit(self, first_step: int = 0) -> None:
        """Train steps first_step .. run.steps-1. Returns when done; a fenced replica exits the process."""
        self.model.train()
        for step in range(first_step, self.cfg.run.steps):
            self.train_step(step)
        while self.pending is not None:  # the last step's decision (retried, it may step ahead again)
            self.settle()
        self.sidecar.finish(self.cfg.run.steps - 1, self.reform_after)

    def train_step(self, step: int) -> rec.StepState:
        # Compute under our own proposal until the agreed plan is known: the one the previous step's
        # commit carries (pipelined: read before anything of this step leaves the process), or for a
        # generation's first step the first proposal compare-and-set (on the sidecar, meanwhile). If
        # another plan won (the epoch or the weights changed) and it assigns us other microbatches,
        # the work is dropped and the step starts over under it (a `replan` event); so it is when the
        # previous step, stepped ahead, turns out retried (our work used parameters that were undone).
        work = StepWork(step, self.accs[step % 2], self.data.step_tokens(step, self.cfg.run.microbatches),
                        time.time())
        plan = self.coord.proposal(self.sidecar.weights)
        agreed = self.carried.pop(step, None) or self.sidecar.plan(step, plan)
        self.carried[step + 1] = work.next_plan
        while True:
            state = self.run_plan(work, plan, agreed)
            if isinstance(state, rec.StepState):
                return state
            proposed = plan.epoch
            # retried before its commit: the previous step's commit, and with it our plan, is still to come
            plan = agreed.result() if agreed.done() else self.coord.proposal(self.sidecar.weights)
            self.log.emit("replan", step=step, replica=self.me, proposed=proposed, agreed=plan.epoch, why=state)

    def run_plan(self, work: StepWork, plan: Plan, agreed: Future) -> rec.StepState | str:
        """Run the step's state machine from `plan`; or why the step must start over (another plan won,
        or the previous step was retried)."""
        work.acc.zero()
        work.timings = {}
        state, actions = rec.start(work.step, self.me, plan.epoch, plan.members, self.cfg.run.microbatches,
                                   plan.weights)

        why = ""

        def before_leaving(state: rec.StepState) -> rec.StepState | None:
            nonlocal why
            if not self.settle():
                why = "previous step retried"
                return None
            self.work = work
            won = agreed.result()
            if won == plan:
                return state
            why = "another plan won"  # keep our work if it is still ours under it
            return rec.adopt(state, won.epoch, won.members, won.weights)

        return self.drive(work, state, deque(actions), before_leaving) or why

    def drive(self, work: StepWork, state: rec.StepState, queue: deque,
              before_leaving: Callable[[rec.StepState], rec.StepState | None] | None = None) -> rec.StepState | None:
        """Execute the policy's actions for `work` until the step commits (or is pending: pipelining).
        `before_leaving` runs once, before the first action that is not a Compute; its None aborts."""
        self.work = work
        while queue:
            action = queue.popleft()
            if before_leaving is not None and not isinstance(action, rec.Compute):
                state, before_leaving = before_leaving(state), None
                if state is None:
                    return None
            if self.can_step_ahead(action):
                self.step_ahead(state, action)
                return state
            event = self.execute(action)
            if event is None:
                continue
            before = state
            state, more = rec.on_event(state, event)
            if state.epoch != before.epoch and not state.phase.terminal:
                self.log.emit("recovery", step=work.step, replica=self.me, from_epoch=before.epoch,
                              to_epoch=state.epoch, redo=sorted(state.owed))
                self.sidecar.recover(work.step - 1, self.coord.members(state.epoch))
            queue.extend(more)
        return state

    def can_step_ahead(self, action: rec.Action) -> bool:
        """Pipeline this step's publish and decision: only while no other step is pending, and when the
        state is small enough to copy each step (speculation.Rollback.affordable)."""
        return isinstance(action, rec.Publish) and self.pending is None and self.rollback.affordable()

    def step_ahead(self, state: rec.StepState, action: rec.Publish) -> None:
        """The optimizer step before the decision (speculation.py): memory only, undone on retry. Our
        done record and count go out beside it on the sidecar, which also compare-and-sets the commit
        if we were the last to publish; else a peer's decision is pushed to us (DecisionWatch) while
        the next step computes. (Publishing on the step's path cost a store round trip there.)"""
        self.before_publish(action.step, action.epoch)
        held = action.held
        published = self.sidecar.publish(action.step, action.epoch, held, [self.work.timings[i] for i in held],
                                         self.coord.staged(action.step, action.epoch, held), len(state.members),
                                         self.coord.proposal(self.sidecar.weights), self.coord.watch_decision)
        if not self.rollback.saved:  # usually saved during the all-reduce (reduce)
            self.rollback.save()
        self.ahead = (action.step, action.epoch, self.step_optimizer())
        self.pending = Pending(self.work, state, action, published)

    def settle(self) -> bool:
        """Read the pending step's decision and finish it; True unless it was retried. Call before
        anything of a later step leaves the process, and once after the last step.

        Commit: the step's events and record. Retry (or the epoch moved first): the optimizer step is
        undone and the step goes on from its intact accumulator until it commits; the caller's step,
        computed on the undone parameters, must start over."""
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        work, state, step, epoch = pending.work, pending.state, pending.action.step, pending.action.epoch
        self.work = work
        t = time.perf_counter()
        count, won = pending.published.result()
        work.waited += time.perf_counter() - t
        state, (action,) = rec.on_event(state, rec.Published(epoch, count))  # Propose commit or AwaitDecision
        if isinstance(action, rec.Propose):
            event = self.decided(step, epoch, won)  # the sidecar compare-and-set it: ours, or a retry
        else:
            event = self.await_outcome(step, epoch, decision=True)
        if event != rec.Decided(epoch, "commit"):
            self.undo_ahead(step, epoch)
        state, more = rec.on_event(state, event)
        self.drive(work, state, deque(more))
        return event == rec.Decided(epoch, "commit")

    def execute(self, action: rec.Action) -> rec.Event | None:
        match action:
            case rec.Compute(step, mbs):
                return self.compute(step, mbs)
            case rec.Reduce(step, epoch):
                return self.reduce(step, epoch)
            case rec.Publish(step, epoch, held):
                self.before_publish(step, epoch)
                self.sidecar.wait_records()  # the record we write of the step before is out (sidecar.py)
                return rec.Published(epoch, self.coord.publish(step, epoch, held,
                                                               [self.work.timings[i] for i in held]))
            case rec.Propose(step, epoch, outcome):
                plan = self.coord.proposal(self.sidecar.weights) if outcome == "commit" else None
                return self.decided(step, epoch, self.coord.propose(step, epoch, outcome, plan))
            case rec.AwaitDecision(step, epoch) | rec.AwaitEpoch(step, epoch):
                return self.await_outcome(step, epoch, decision=isinstance(action, rec.AwaitDecision))
            case rec.Apply(step, epoch):
                self.apply(step, epoch)
                return None
            case rec.Fence(step, reason):
                self.fence(step, reason)
        raise AssertionError(f"unhandled action {action!r}")

    def before_publish(self, step: int, epoch: int) -> None:
        self.hb.at(step, "commit", epoch=epoch)
        self.faults.at(step, "commit")

    def decided(self, step: int, epoch: int, won: Decision) -> rec.Decided:
        """The event for a decision of the running step (`self.work`), kept for its Apply; the
        proposer logs it."""
        if won.proposer == self.me:
            self.log.emit("decision", step=step, epoch=epoch, outcome=won.outcome, replica=self.me)
        self.work.decision = won
        return rec.Decided(epoch, won.outcome, self.coord.chain_after(epoch) if won.outcome == "retry" else ())

    def await_outcome(self, step: int, epoch: int, decision: bool) -> rec.Decided | rec.EpochChanged:
        t = time.perf_counter()
        kind, value = self.wait(step, epoch, decision)
        self.work.waited += time.perf_counter() - t
        if kind == "decided":
            return self.decided(step, epoch, value)
        return rec.EpochChanged(value)

    def wait(self, step: int, epoch: int, decision: bool) -> tuple[str, object]:
        """Wait for the decision of (step, epoch) (if `decision`) or a new epoch.

        A collective that timed out on a live straggler leaves the epoch's group broken with nobody
        dead, so the coordinator would never start a new epoch: after `reform_after` s (time enough
        for it to find a real death first) ask it for the same members in a new epoch, then wait
        on. Raises TimeoutError after wait_s more."""
        try:
            return self.coord.wait_for(step, epoch, decision, self.reform_after)
        except TimeoutError:
            self.coord.request_reform(epoch, f"replica {self.me} waited {self.reform_after:g} s in step {step}")
            return self.coord.wait_for(step, epoch, decision, self.wait_s)

    def compute(self, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        """Forward/backward each microbatch into the accumulator. Randomness is a function of (seed, step, i)."""
        for n, i in enumerate(microbatches):
            self.hb.at(step, "compute", i)
            mb = self.data.microbatch(step, i)
            span = self.clock.start()  # device time (devicetime.py): what the detector reads
            seed_microbatch(mix(self.cfg.run.seed, step, i))  # dropout: per microbatch, never per rank
            loss = self.model(mb.x, mb.y) * loss_weight(mb.tokens, self.work.tokens)
            loss.backward()
            self.work.acc.add(loss)
            self.faults.stretch(step, span)
            seconds, wall = span.stop()
            self.work.timings[i] = (mb.tokens, mb.sumsq, seconds)
            self.log.emit("compute", step=step, replica=self.me, microbatch=i, seconds=round(seconds, 6),
                          wall=round(wall, 6), tokens=mb.tokens, sumsq=mb.sumsq)
            if n == 0:
                self.faults.at(step, "compute")  # a kill here loses finished and unfinished work alike
        return rec.Computed(microbatches)

    def reduce(self, step: int, epoch: int) -> rec.Event:
        """All-reduce a copy of the accumulator in the epoch's group; the accumulator stays intact."""
        self.hb.at(step, "allreduce", epoch=epoch)
        if self.coord.epoch() > epoch:
            return rec.EpochChanged(self.coord.chain_after(epoch))
        if epoch not in self.groups:
            self.groups[epoch] = EpochGroup(self.coord.group_store(), epoch, self.coord.members(epoch), self.me,
                                            self.cfg.coord.collective_timeout)
        held = tuple(sorted(self.work.timings))  # what this member computed in the step: the policy's `held`

        def issued() -> None:  # while the reduction runs (off the path): the done record, the copy of
            self.faults.at(step, "allreduce")  # the state a step ahead would need, a record's digest
            self.coord.stage(step, epoch, held, [self.work.timings[i] for i in held])
            if self.pending is None and not self.rollback.saved and self.rollback.affordable():
                self.rollback.save()
            self.sidecar.digest_now()  # the step record we write of the step before (sidecar.py)

        buffer = self.work.acc.buffer
        if self.scratch is None or self.scratch.dtype != buffer.dtype:
            self.scratch = torch.empty_like(buffer)
        try:
            result = self.groups[epoch].allreduce(buffer, lambda: self.coord.epoch() > epoch, on_issued=issued,
                                                  into=self.scratch)
        except EpochMoved:
            self.scratch = None  # the abandoned collective may still write it
            return rec.EpochChanged(self.coord.chain_after(epoch))
        except CollectiveError as e:
            self.scratch = None
            self.log.emit("reduce", step=step, replica=self.me, epoch=epoch, ok=False, error=str(e))
            return rec.ReduceFailed(epoch, str(e))
        self.reduced = result.tensor
        self.log.emit("reduce", step=step, replica=self.me, epoch=epoch, ok=True, seconds=round(result.seconds, 6))
        return rec.Reduced(epoch)

    def step_optimizer(self) -> float:
        """Reduced gradient into .grad, optimizer step; returns the step's loss."""
        loss = self.work.acc.load_grads(self.reduced)
        if self.persist:
            self.persist.before_optimizer()  # the last snapshot's copy must have left the tensors
        self.sidecar.wait_records()  # the last step record's hash must have read the parameters first
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.work.stepped = time.time()
        return loss

    def undo_ahead(self, step: int, epoch: int) -> None:
        self.rollback.restore()
        self.work.acc.attach()  # the step goes on: backward must add into its buffer again
        self.ahead = None
        self.log.emit("undone", step=step, replica=self.me, epoch=epoch)

    def apply(self, step: int, epoch: int) -> None:
        """The committed step: optimizer step (unless taken ahead), digest, events, step record; the
        next step's plan, which the commit carries."""
        commit = self.work.decision
        if commit is None or commit.plan is None:
            raise RuntimeError(f"step {step} applied without its commit decision")
        self.work.next_plan.set_result(commit.plan)
        self.hb.at(step, "optimizer", epoch=epoch)
        self.faults.at(step, "optimizer")
        if self.ahead is not None and self.ahead[:2] == (step, epoch):
            loss, self.ahead = self.ahead[2], None
        else:
            loss = self.step_optimizer()
        self.rollback.drop()  # the state moved on: a copy saved during the reduce is stale now
        self.log.emit("applied", step=step, replica=self.me, epoch=epoch, state_digest=state_digest(self.params),
                      waited=round(self.work.waited, 6))
        if self.persist:
            self.persist.after_commit(step, self.coord.members(epoch), lambda: self.faults.at(step, "snapshot"))
        # The commit's proposer writes the step record (sha256 included) beside the next step's
        # compute (sidecar.py), off the path every peer waits on.
        self.sidecar.record(step, epoch, self.coord.members(epoch), commit.proposer, dict(
            step=step, loss=loss, microbatches=self.cfg.run.microbatches, tokens=self.work.tokens,
            step_time=round(self.work.stepped - self.work.started, 6)))

    def fence(self, step: int, reason: str) -> None:
        self.log.emit("fenced", replica=self.me, step=step, reason=reason)
        os._exit(3)
