"""Validation loss after a committed step, computed by the live members and exact whoever computes it.

Owns: when a member evaluates (after applying step s where (s + 1) % eval.every == 0), the evaluation data
(eval.path's files, or the eval.split of the training data that training never reads: model/data), which
microbatches each member of the commit computes (i goes to the (i mod n)-th of its n members, in id order),
taking over a lost member's unfinished ones, and the `eval` record. A member is a replica group: in a group of
several ranks (FSDP2, TP) every rank forwards each of the group's evaluation microbatches whole, in the same
order (rank 0's look at the store, broadcast over the group), and rank 0 publishes; through pipeline stages
each rank forwards its shard's rows and the last stage's loss is summed over the group. Not in a shrunk
group (config refuses on_rank_loss=replan). Does not own: the step protocol
(step.py calls `after_commit` from its Apply), membership (the coordinator), the model.

Why it is exact. Evaluation microbatch i is the same at every evaluation (`microbatch(0, i)` of the
evaluation source, as torchtitan's validator re-reads its set) and its loss is a pure function of the
committed parameters, which every member holds bitwise; no dropout (eval mode), no gradient. Each result
(loss x tokens as a float64, its tokens) goes to the store under its index, and the record sums them in
index order, so the value is the failure-free run's bit for bit whoever computed which share, --exact or
not. A member that dies mid-evaluation leaves its unfinished indices missing: once the coordinator's new
epoch drops it, the survivors among the commit's members share them out (the i-th missing one to the
(i mod n)-th survivor) and compute them. Members wait until every result is in before they go on, so no
member is in a collective of the next step while another still evaluates.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace

import torch

from unbroken.config import Config
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.stepwork import model_inputs

POLL_S = 0.05  # between looks at the store and the epoch while waiting for the others' results


def eval_source(cfg: Config):
    """The evaluation microbatches' DataSource: eval.path's files, else the held-out eval.split."""
    from unbroken.model.data import DataSource

    e = cfg.eval
    if e.path:
        return DataSource(replace(cfg.data, path=e.path), cfg.model.block_size, cfg.run.seed,
                          microbatches=e.microbatches)
    return DataSource(cfg.data, cfg.model.block_size, cfg.run.seed, microbatches=e.microbatches,
                      held_out=e.split, part="eval")


class Evaluator:
    """One member's part in each evaluation. Build once per trainer where eval.every > 0; call
    `after_commit(step, members)` from the Apply of every committed step, after the optimizer step."""

    def __init__(self, cfg: Config, me: int, model, coord, log, heartbeat, injector, device, inputs, wait_s: float,
                 group=None, rank: int = 0, stages=None, role=None):
        """`group`: the replica group's own process group where it has several ranks (FSDP2, TP: every rank
        forwards each whole evaluation microbatch with the others, their collectives in step), None for
        one rank; `rank`: this rank's index in it (rank 0 publishes and records); `stages`: its pipeline
        stage (parallel/pipeline.py), None without; `role`: the rank's RankRole (whose rows it computes,
        whether it counts the loss), needed with stages."""
        self.cfg, self.me, self.model, self.coord, self.log = cfg, me, model, coord, log
        self.hb, self.faults, self.device, self.inputs, self.wait_s = heartbeat, injector, device, inputs, wait_s
        self.group, self.rank, self.stages, self.role = group, rank, stages, role
        self.source = eval_source(cfg)
        self.n = cfg.eval.microbatches

    def due(self, step: int) -> bool:
        return (step + 1) % self.cfg.eval.every == 0

    def after_commit(self, step: int, members: tuple[int, ...]) -> None:
        """Evaluate the parameters committed after `step` if due: this member's share, then any lost
        member's the survivors owe, until every result is in; the record by one member. Returns early
        where this member was dropped from the membership meanwhile (the step loop fences it)."""
        if not self.due(step):
            return
        members = tuple(sorted(members))
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for n, i in enumerate(i for i in range(self.n) if members[i % len(members)] == self.me):
                    self._compute(step, i)
                    if n == 0:
                        self.faults.at(step, "eval")  # a kill here leaves the rest of its share to the others
                if not self._complete(step, members):
                    return
        finally:
            self.model.train(training)
        self._record(step)

    def _compute(self, step: int, i: int) -> None:
        self.hb.at(step, "eval", i)
        if self.stages is not None:
            return self._compute_stages(step, i)
        mb = self.source.microbatch(0, i)
        loss = self.model(mb.x.to(self.device), mb.y.to(self.device), **model_inputs(mb, self.inputs, self.device))
        if self.rank == 0:  # a group's ranks computed the same value
            self.coord.store.set(keys.eval_result(step, i), json.dumps([float(loss) * mb.tokens, mb.tokens, self.me]))

    def _compute_stages(self, step: int, i: int) -> None:
        """Microbatch i through the group's pipeline, forward only: each rank its shard's rows; the last
        stage's ranks that count the loss (TP index 0) hold (loss x tokens, tokens) of their rows, summed
        over the group in float64, which rank 0 (stage 0) publishes."""
        import torch.distributed as dist

        from unbroken.model.data import part

        whole, role = self.source.microbatch(0, i), self.role
        total = torch.zeros(2, dtype=torch.float64)
        for share in role.computes:
            mb = part(whole, share, role.shares)
            loss = self.stages.evaluate(mb)
            if loss is not None and role.counts_loss:
                total += torch.tensor([float(loss) * mb.tokens, mb.tokens], dtype=torch.float64)
        total = total.to(self.device)
        dist.all_reduce(total, group=self.group)
        if self.rank == 0:
            loss_sum, tokens = total.cpu().tolist()
            self.coord.store.set(keys.eval_result(step, i), json.dumps([loss_sum, int(tokens), self.me]))

    def _look(self, step: int) -> tuple[list[int], int]:
        """(the missing results, the latest epoch): this rank's look at the store; in a group of several
        ranks rank 0's, broadcast, so that every rank of the group computes the same microbatches in the
        same order (their collectives pair up)."""
        store = self.coord.store
        if self.group is None or self.rank == 0:
            missing = [int(not store.check([keys.eval_result(step, i)])) for i in range(self.n)]
            view = torch.tensor([self.coord.epoch(), *missing], dtype=torch.int64)
        else:
            view = torch.zeros(self.n + 1, dtype=torch.int64)
        if self.group is not None:
            import torch.distributed as dist

            view = view.to(self.device)  # the group's own backend: NCCL between GPUs
            dist.broadcast(view, group=self.group, group_src=0)
            view = view.cpu()
        return [i for i in range(self.n) if view[1 + i]], int(view[0])

    def _complete(self, step: int, members: tuple[int, ...]) -> bool:
        """Wait for every result, computing the lost members' missing ones this member owes; False where
        this member left the membership. Raises TimeoutError after wait_s s without progress."""
        last, since = None, time.monotonic()
        while True:
            missing, epoch = self._look(step)
            if not missing:
                return True
            live = sorted(set(self.coord.members(epoch)) & set(members))
            if self.me not in live:
                return False
            lost = [i for i in missing if members[i % len(members)] not in live]
            mine = [i for k, i in enumerate(lost) if live[k % len(live)] == self.me]
            for i in mine:  # another survivor may be computing it too: the same value
                self._compute(step, i)
            if (missing, live) != last:
                last, since = (missing, live), time.monotonic()
            elif time.monotonic() - since > self.wait_s:
                raise TimeoutError(f"evaluation after step {step}: microbatches {missing} missing for "
                                   f"{self.wait_s:g} s (members {live})")
            if not mine:
                time.sleep(POLL_S)

    def _record(self, step: int) -> None:
        """Sum the results in index order (float64) and write the `eval` record, once (compare-and-set)."""
        if self.rank != 0:
            return
        store = self.coord.store
        values = [json.loads(v) for v in store.multi_get([keys.eval_result(step, i) for i in range(self.n)])]
        total, tokens = 0.0, 0
        owners: dict[str, list[int]] = {}
        for i, (loss_sum, n, who) in enumerate(values):
            total += loss_sum
            tokens += n
            owners.setdefault(str(who), []).append(i)
        if store.compare_set(keys.eval_recorder(step), "", str(self.me)).decode() == str(self.me):
            self.log.emit("eval", step=step, loss=total / tokens, tokens=tokens, microbatches=self.n,
                          owners=owners, replica=self.me)
