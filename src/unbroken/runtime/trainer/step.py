"""One replica's training loop: the step protocol of docs/design.md, executing `policy.recovery` actions.

Owns: turning each action of the recovery state machine into real work (forward/backward into the
step's accumulator, an all-reduce of a copy, store reads and compare-and-sets, the optimizer step) and
each outcome into the next event; the per-microbatch RNG; the events of this rank. Does not own:
decisions (policy), membership (the coordinator), building what it trains or the process's life
(lifecycle.py, admission.py), the step's data (stepwork.py: passed to each phase, never kept here), this
rank's part in a step (role.py), commit pipelining's bookkeeping (speculation.py), the reduction
(reduction.py).

A step, top to bottom (`train_step`, then `run_plan`):
  plan = our proposal (epoch, members, quota weights); the agreed plan comes with the step before's
                                               commit (a generation's first step: compare-and-set)
  policy says Compute(owned microbatches)   -> forward/backward each into this step's accumulator
  settle the previous, pipelined step       -> its decision read, its Apply run (or, retried, the step
                                               starts over: Restart.PREVIOUS_RETRIED)
  adopt the agreed plan                     -> or start over under it (Restart.ANOTHER_PLAN_WON)
  policy says Reduce(epoch)                 -> all-reduce a copy in the epoch's group (or: epoch moved);
                                               reduction.py: in buckets, from the last backward on
  policy says Publish / Propose / Await...  -> done count, compare-and-set decision, or wait for one
  on retry: policy replays the new membership, says Compute(what the dead owned) -> Reduce(new epoch)
  policy says Apply                         -> load reduced grads, optimizer step, digest, events;
                                               the commit's proposer writes the step record (sidecar)

Commit pipelining (run.step_ahead, speculation.py): where the policy says Publish, the publish goes to
the sidecar and the optimizer steps at once; the next step settles this one's decision before anything
of its own leaves the process. Without it every member would wait for the last to publish: a second
synchronisation point each step that DDP lacks.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from enum import Enum

import torch
import torch.distributed as dist

from unbroken.config import Config
from unbroken.events import EventLog
from unbroken.policy import recovery as rec
from unbroken.runtime.parallel.accumulator import local, param_digest, unique_parameters
from unbroken.runtime.parallel.crossgroup import CrossGroup, choose, epoch_group
from unbroken.runtime.parallel.parallelize import release_agent
from unbroken.runtime.store.reasons import evicted, lost_rank
from unbroken.runtime.trainer.devicetime import DeviceClock
from unbroken.runtime.trainer.evaluation import Evaluator
from unbroken.runtime.trainer.donor import Donor
from unbroken.runtime.trainer.faults import Injector
from unbroken.runtime.trainer.heartbeat import Heartbeat
from unbroken.runtime.trainer.backend import Computing, backend_for
from unbroken.runtime.trainer.integrity import Integrity
from unbroken.runtime.trainer.membership import Coordination, Decision, FencedOut, GroupLost, Plan
from unbroken.runtime.trainer.optimizing import Optimizing
from unbroken.runtime.trainer.reduction import Reducer, cut_apart_line
from unbroken.runtime.trainer.role import RankRole
from unbroken.runtime.trainer.sidecar import Sidecar
from unbroken.runtime.trainer.speculation import Pipeline, Rollback, limit
from unbroken.runtime.trainer.stepwork import GradientSink, OwnShard, Parts, StepWork


class Restart(str, Enum):
    """Why a step's work is dropped and the step starts over under the agreed plan (a `replan` event)."""
    PREVIOUS_RETRIED = "previous step retried"  # our work used parameters that were undone
    ANOTHER_PLAN_WON = "another plan won"  # and it assigns us other microbatches
    HEALED = "state healed from a peer"  # our work used corrupted parameters (agreement.py)


class Settled(Enum):
    """What settling the previous, pipelined step found."""
    NOTHING = "nothing pending"
    COMMITTED = "committed"
    RETRIED = "retried"


class Trainer:
    """One rank's step loop. Build once per process incarnation (after `parallelize`), then call `fit`
    once."""

    def __init__(self, cfg: Config, who, parts: Parts, coord: Coordination, log: EventLog,
                 heartbeat: Heartbeat, injector: Injector, sidecar: Coordination, persist=None,
                 lr_schedule: Callable[[int], float] | None = None):
        self.cfg, self.me, self.coord, self.log = cfg, who.group, coord, log
        self.hb, self.faults, self.persist = heartbeat, injector, persist
        self.model, self.data, self.optimizer, self.group = parts.model, parts.data, parts.optimizer, parts.group
        self.stages, self.inputs = parts.stages, parts.inputs
        self.params = unique_parameters(self.model)
        self.optimizing = Optimizing(cfg, parts, self.params, lr_schedule)
        # A replica group of G ranks (FSDP2, tensor parallel or pipeline stages inside): its ranks run this
        # same loop on the same events, each computing its share of the group's microbatches (its rows of
        # each; its heads and units of all; or its stage of all) and reducing its own shard across groups.
        standin = parts.standin
        self.role = RankRole.of(cfg.topology(), who, parts.group is not None,
                                standin.held if standin else None, standin.shares if standin else 1,
                                cfg.parallel.on_rank_loss == "replan")
        self.device = local(self.params[0]).device  # where microbatches go (admission.build put the model there)
        self.clock = DeviceClock(self.device, cfg.run.threads)
        self.holding = standin or OwnShard(self.params, who.rank)  # what it holds of each shard index
        # the layout's compute backend, chosen once (backend.py): its accumulators, hooks and compute
        self.backend = backend_for(self.model, self.params, self.role, cfg.run.exact, self.stages, standin)
        self.accs = [self.backend.accumulator()]  # and a second while a pipelined step awaits its decision
        self.sink = GradientSink(self.accs[0])  # gradient hooks -> the accumulator of the step computing
        self.backend.hook(self.sink)
        self.groups: dict[tuple[int, tuple[int, ...], int], CrossGroup] = {}  # (epoch, members, shard) -> group
        self.copies: dict[int, torch.Tensor] = {}  # each step's all-reduce copies (StepWork.copies)
        self.seen_epoch = -1  # the latest epoch `ahead` looked at
        self.wait_s = 4 * cfg.coord.collective_timeout
        self.reform_after = 2 * cfg.coord.heartbeat_timeout  # see wait()
        self.sidecar = Sidecar(sidecar, log, cfg.parallel.group_size, self.wait_s, self.role.holds)
        # Snapshots and checkpoints of a step start once it is known committed; pipelined, that comes
        # after the next step's compute, so their copy would no longer overlap it: "auto" does not
        # pipeline with them. A group's ranks do not step ahead: a rollback of sharded state is not built.
        mode = "off" if (persist and cfg.run.step_ahead == "auto") or self.role.ranks > 1 else cfg.run.step_ahead
        self.pipeline = Pipeline(Rollback(self.params, self.optimizer, limit(mode, self.params[0].device)),
                                 log, self.me)
        self.reducer = Reducer(self.role, coord, log, injector, heartbeat, self.pipeline, self.group_of, self.params,
                               self.accs, choose(cfg.parallel.cross_backend, self.device) == "gloo",
                               int(cfg.parallel.bucket_mb * 2 ** 20))
        self.evaluator = Evaluator(cfg, self.me, self.model, coord, log, heartbeat, injector, self.device,
                                   self.inputs, self.wait_s, parts.group, who.rank, self.stages,
                                   self.role) if cfg.eval.every else None
        self.donor = Donor(coord, log, self.me, who.rank, self.role.holds, self.model, self.optimizer,
                           cfg.coord.collective_timeout, (lambda j: lambda: standin.heal_tensors(
                               j, self.optimizer)) if standin else None, self.role.shard_tag)
        # silent corruption (integrity.py): flips, recomputed microbatches, finite and state checks
        self.integrity = Integrity(cfg, coord, log, self.me, who.rank, parts, self.params, injector.flips,
                                   self.role.holds, self.donor.shard, self.role.shard_tag,
                                   self.role.ranks == 1 and standin is None and self.stages is None, self.device)
        self.healed = False  # the state check replaced our state since this step's compute began
        self.backend.attach(Computing(cfg, self.role, self.model, self.data, self.device, self.inputs, self.clock,
                                      heartbeat, injector, self.holding, self.reducer, self.integrity, self.ahead,
                                      self.record_compute))

    def free_accumulator(self):
        """The accumulator a new step computes into: the first, unless the step pending its decision
        (commit pipelining) holds it; then a second, built the first time. A run that never steps ahead
        holds one buffer (numel x 4 or 8 bytes), not two."""
        pending = self.pipeline.pending
        if pending is None or pending.work.acc is not self.accs[0]:
            return self.accs[0]
        if len(self.accs) == 1:
            self.accs.append(self.backend.accumulator())
        return self.accs[1]

    # -- the loop ---------------------------------------------------------------------------------------

    def fit(self, first_step: int = 0, plan: Plan | None = None) -> None:
        """Train steps first_step .. run.steps-1 (a joiner: from the step after the one it healed to, under
        that step's `plan`). Returns when done; raises FencedOut where this rank was declared dead."""
        carried = None
        if plan is not None:
            carried = Future()
            carried.set_result(plan)
        self.model.train()
        for step in range(first_step, self.cfg.run.steps):
            carried = self.train_step(step, carried).next_plan
        while self.pipeline.pending is not None:  # the last step's decision (retried, it may step ahead again)
            self.settle_previous()
        self.sidecar.finish(self.cfg.run.steps - 1, self.reform_after)

    def train_step(self, step: int, carried: Future | None = None) -> StepWork:
        """One step until it commits (pipelined: until it stepped ahead of its decision); its work.

        Compute under our own proposal until the agreed plan is known: the one the previous step's commit
        carries (`carried`), or for a generation's first step the first proposal compare-and-set (on the
        sidecar, meanwhile). If another plan won and it assigns us other microbatches, or the previous
        step turns out retried, the work is dropped and the step starts over under the agreed plan."""
        work = StepWork(step, self.free_accumulator(), self.data.step_tokens(step, self.cfg.run.microbatches),
                        time.time(), copies=self.copies)
        plan = self.coord.proposal(self.sidecar.weights)
        agreed = carried or self.sidecar.plan(step, plan)
        if self.role.ranks > 1:  # a group's ranks must compute the same microbatches: the agreed plan's
            plan = agreed.result()
        while isinstance(restart := self.run_plan(work, plan, agreed), Restart):
            proposed = plan.epoch
            # retried before its commit: the previous step's commit, and with it our plan, is still to come
            plan = agreed.result() if agreed.done() else self.coord.proposal(self.sidecar.weights)
            self.log.emit("replan", step=step, replica=self.me, proposed=proposed, agreed=plan.epoch,
                          why=restart.value, **self.role.tag)
        return work

    def run_plan(self, work: StepWork, plan: Plan, agreed: Future) -> rec.StepState | Restart:
        """The step's state machine from `plan`, to its commit; or why the step must start over."""
        work.acc.zero()
        work.timings, self.healed = {}, False
        state, actions = rec.start(work.step, self.me, plan.epoch, plan.members, self.cfg.run.microbatches,
                                   plan.weights, self.role.indices)
        self.integrity.begin(work.step, state.epoch, state.owners, state.members)
        queue = deque(actions)
        settled = self.pipeline.pending is None and agreed.done() and agreed.result() == plan
        self.reducer.target(work, state, queue, settled)  # overlap its reduction with its last backward?
        while queue and isinstance(queue[0], rec.Compute):  # local work: nothing leaves the process
            state = self.advance(work, state, queue)
        if queue:  # before anything of this step leaves the process
            if self.settle_previous() is Settled.RETRIED:
                return Restart.PREVIOUS_RETRIED
            if self.healed:  # the pipelined previous step's check replaced the state we computed with
                return Restart.HEALED
            won = agreed.result()
            if won != plan:  # keep our work if it is still ours under the agreed plan
                state = rec.adopt(state, won.epoch, won.members, won.weights)
                if state is None:
                    return Restart.ANOTHER_PLAN_WON
        return self.drive(work, state, queue)

    def settle_previous(self) -> Settled:
        """Read the pipelined previous step's decision and finish that step: its Apply on a commit, or its
        recovery to a commit on a retry (its optimizer step undone). Call before anything of the current
        step leaves the process, and after the last step until nothing is pending."""
        settlement = self.pipeline.settle(self)
        if settlement is None:
            return Settled.NOTHING
        self.drive(settlement.work, settlement.state, deque(settlement.actions))
        return Settled.COMMITTED if settlement.committed else Settled.RETRIED

    def drive(self, work: StepWork, state: rec.StepState, queue: deque) -> rec.StepState:
        """Execute the policy's actions for `work` until its step commits (or steps ahead: pipelining)."""
        while queue:
            if self.pipeline.can_step_ahead(queue[0]):
                self.step_ahead(work, state, queue.popleft())
                return state
            state = self.advance(work, state, queue)
        return state

    def advance(self, work: StepWork, state: rec.StepState, queue: deque) -> rec.StepState:
        """Execute the action at the head of `queue`; the policy's next state, its actions queued."""
        action = queue.popleft()
        work.members = state.members
        event = self.execute(work, action)
        if event is None:
            return state
        before = state
        state, more = rec.on_event(state, event)
        if state.epoch != before.epoch and not state.phase.terminal:
            self.log.emit("recovery", step=work.step, replica=self.me, from_epoch=before.epoch,
                          to_epoch=state.epoch, redo=sorted(state.owed), **self.role.tag)
            self.sidecar.recover(work.step - 1, state.members)
        queue.extend(more)
        return state

    def execute(self, work: StepWork, action: rec.Action) -> rec.Event | None:
        self.ahead()
        match action:
            case rec.Compute(step, mbs):
                computed = self.compute(work, step, mbs)
                self.integrity.finite(work, step, mbs)  # before any of it is reduced (or this process leaves)
                return computed
            case rec.Reduce(step, epoch, members):
                return self.reducer.reduce(work, step, epoch, members)
            case rec.Publish(step, epoch, held):
                self.before_publish(step, epoch)
                self.sidecar.wait_records()  # the record we write of the step before is out (sidecar.py)
                return rec.Published(epoch, self.coord.publish(step, epoch, held, work.timings_of(held),
                                                               count=len(self.role.holds), ranks=self.role.timed))
            case rec.Propose(step, epoch, outcome):
                plan = self.sidecar.fresh(self.coord.proposal(self.sidecar.weights)) if outcome == "commit" else None
                return self.decided(work, step, epoch, self.coord.propose(step, epoch, outcome, plan))
            case rec.AwaitDecision(step, epoch) | rec.AwaitEpoch(step, epoch):
                return self.await_outcome(work, step, epoch, decision=isinstance(action, rec.AwaitDecision))
            case rec.Apply(step, epoch):
                self.apply(work, step, epoch)
                return None
            case rec.Fence(step, reason):
                self.fence(step, reason)
        raise AssertionError(f"unhandled action {action!r}")

    def step_ahead(self, work: StepWork, state: rec.StepState, action: rec.Publish) -> None:
        """Publish on the sidecar and step the optimizer before the decision (speculation.py). Our done
        record and count go out beside it, and the sidecar compare-and-sets the commit if we were the
        last to publish; else a peer's decision is pushed to us (DecisionWatch) while the next step
        computes."""
        self.before_publish(action.step, action.epoch)
        held = action.held
        published = self.sidecar.publish(action.step, action.epoch, held, work.timings_of(held),
                                         self.coord.staged(action.step, action.epoch, held),
                                         len(state.members) * self.role.indices,
                                         self.coord.proposal(self.sidecar.weights), self.coord.watch_decision)
        self.pipeline.step_ahead(work, state, action, published, lambda: self.step_optimizer(work))

    # -- what the actions do ------------------------------------------------------------------------------

    def ahead(self) -> None:
        """Before each action (a local read unless the epoch moved): groups a newly admitted joiner will
        need start forming on their threads while we go on, its heal group (donor.py) and, where the
        latest epoch admits, that epoch's cross-group groups: the next step, the joiner's first, then
        finds them formed instead of waiting for a rendezvous of every member."""
        latest = self.coord.epoch()
        if latest == self.seen_epoch:
            return
        self.donor.prepare(latest)
        self.seen_epoch, members = latest, tuple(sorted(self.coord.members(latest)))
        if latest > 0 and self.me in members and set(self.coord.members(latest - 1)) < set(members):
            for shard in self.role.holds:
                self.group_of(latest, members, shard)

    def group_of(self, epoch: int, members: tuple[int, ...], shard: int) -> CrossGroup:
        """The cross-group group of `members` in `epoch` for shard index `shard`, formed from the first ask."""
        key = (epoch, members, shard)
        if key not in self.groups:
            self.groups[key] = epoch_group(self.cfg.parallel.cross_backend, self.device, self.coord.group_store(),
                                           epoch, members, self.me, self.cfg.coord.collective_timeout, shard=shard)
        return self.groups[key]

    def before_publish(self, step: int, epoch: int) -> None:
        self.hb.at(step, "commit", epoch=epoch)
        self.faults.at(step, "commit")

    def decided(self, work: StepWork, step: int, epoch: int, won: Decision) -> rec.Decided:
        """The event for a decision of `work`'s step, kept for its Apply; the proposer logs it."""
        if won.proposer == self.me and self.role.rank == 0:
            self.log.emit("decision", step=step, epoch=epoch, outcome=won.outcome, replica=self.me)
        work.decision = won
        return rec.Decided(epoch, won.outcome, self.chain_after(epoch) if won.outcome == "retry" else ())

    def chain_after(self, epoch: int):
        """The epochs after `epoch` up to the latest, as the retry of `epoch` replays them. A group's ranks
        read the store at different times and could see different latest epochs, then redo different
        microbatches (and FSDP's collectives would pair mismatched work): they agree on the newest any
        of them saw (a max over the group; every rank of the group reaches each retry once, in order)."""
        chain = self.coord.chain_after(epoch)
        if self.group is None:
            return chain
        latest = torch.tensor([chain[-1][0] if chain else epoch], dtype=torch.int64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=self.group)
        return tuple((e, self.coord.members(e)) for e in range(epoch + 1, int(latest) + 1))

    def await_outcome(self, work: StepWork, step: int, epoch: int, decision: bool) -> rec.Decided | rec.EpochChanged:
        t = time.perf_counter()
        kind, value = self.wait(step, epoch, decision)
        work.waited += time.perf_counter() - t
        if kind == "decided":
            return self.decided(work, step, epoch, value)
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

    def compute(self, work: StepWork, step: int, microbatches: tuple[int, ...]) -> rec.Event:
        """Forward/backward each microbatch into the step's accumulator, as this rank's layout computes
        them (backend.py: chosen once, at build)."""
        self.sink.point_at(work.acc)
        return self.backend.compute(work, step, microbatches)

    def record_compute(self, work: StepWork, step: int, i: int, mb, seconds: float, wall: float) -> None:
        """Microbatch i's timing for the detector (published with the step) and its `compute` event."""
        work.timings[i] = (mb.tokens, mb.sumsq, seconds)
        self.log.emit("compute", step=step, replica=self.me, microbatch=i, seconds=round(seconds, 6),
                      wall=round(wall, 6), tokens=mb.tokens, sumsq=mb.sumsq, **self.role.tag)

    def step_optimizer(self, work: StepWork) -> float:
        """Reduced gradient into .grad, clipped by its global norm, optimizer step at the step's lr;
        returns the step's loss (the lr and the norm go to `work` for the step record)."""
        loss = self.optimizing.prepare(work)  # a group's rank: its share (the record sums the shares)
        if self.persist:
            self.persist.before_optimizer()  # the last snapshot's copy must have left the tensors
        # the record job of the step before is done (it reads no parameters: it takes `apply`'s digests),
        # its error raised here, before the state moves on
        self.sidecar.wait_records()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        work.stepped = time.time()
        return loss

    def apply(self, work: StepWork, step: int, epoch: int) -> None:
        """The committed step: optimizer step (unless taken ahead), digest, events, step record; the
        next step's plan, which the commit carries."""
        commit = work.decision
        if commit is None or commit.plan is None:
            raise RuntimeError(f"step {step} applied without its commit decision")
        work.next_plan.set_result(commit.plan)
        self.hb.at(step, "optimizer", epoch=epoch)
        self.faults.at(step, "optimizer")
        loss = self.pipeline.loss_ahead(step, epoch)
        if loss is None:
            loss = self.step_optimizer(work)
        self.pipeline.rollback.drop()  # the state moved on: a copy saved during the reduce is stale now
        self.healed |= self.integrity.after_apply(step, epoch, work.members)  # flips, the state check
        digests = {shard: param_digest(self.holding.parameters(shard)) for shard in self.role.holds}
        for shard, digest in digests.items():
            self.log.emit("applied", step=step, replica=self.me, epoch=epoch, state_digest=digest,
                          waited=round(work.waited, 6), **self.role.shard_tag(shard))
        members = work.members
        if self.persist:
            self.persist.after_commit(step, members, lambda: self.faults.at(step, "snapshot"))
        # The commit's proposer writes the step record (its digest included) beside the next step's
        # compute (sidecar.py), off the path every peer waits on; a heal too.
        self.sidecar.record(step, epoch, members, commit.proposer, dict(
            step=step, loss=loss, microbatches=self.cfg.run.microbatches, tokens=work.tokens,
            step_time=round(work.stepped - work.started, 6), lr=work.lr, grad_norm=work.grad_norm), digests)
        self.donor.heal(step, members, commit.plan)
        if self.evaluator is not None:  # the committed parameters' validation loss (evaluation.py)
            self.evaluator.after_commit(step, members)

    def fence(self, step: int, reason: str) -> None:
        """Leave the run: declared dead, this process must write nothing into a later step. Raises
        FencedOut (the lifecycle exits 3), or GroupLost where its group was declared dead for another rank
        and may go on shrunk on this one (parallel.on_rank_loss=replan): the lifecycle then asks the
        coordinator."""
        dead = self.coord.dead_reason() if self.role.shrinkable else None
        if dead is not None and lost_rank(dead) not in (None, self.role.rank):
            raise GroupLost(dead)
        if self.hb.latch.claim():  # else its heartbeat thread found the verdict first, logged it and exits
            said = cut_apart_line(self.me, self.coord.dead_reason(), self.reducer.last_failure)
            if said:
                print(said, file=sys.stderr)
            self.log.emit("fenced", replica=self.me, step=step, reason=reason, **self.role.tag)
            release_agent(self.cfg.parallel.on_rank_loss == "replan", evicted(dead or "", self.role.rank))
        raise FencedOut(reason)
