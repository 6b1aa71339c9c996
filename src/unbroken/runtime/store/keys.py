"""Every key of the coordinator's store, spelled once.

Owns: the names. Each function returns one key (or a key prefix, for `PrefixStore`); ids are replica
group ids (`group`), steps (`step`, from 0) and membership epochs (`epoch`). No other module spells a
key string (tests/test_architecture.py checks it), so the layout below is the whole protocol on the
store. Does not own: what is written under a key or who reads it (trainer/membership.py, coordinator/coordinator.py,
snapshot/control.py).

Values are utf-8. Under the generation prefix `g{N}/` (a whole-job restart starts generation N + 1):
  epoch                 current membership epoch (int)           coordinator
  members/{e}           JSON list of member groups of epoch e     coordinator, before `epoch`
  epochs/{e}            "1" once epoch e began (wakes watches)    coordinator, after `epoch`
  dead/{g}              JSON {"epoch", "reason"}                  coordinator (fences zombies)
  reform/{e}            JSON {"replica", "reason"}: epoch e's collective group broke, nobody died
  hb/{g}, hb/{g}.{j}    JSON {"seq","step","phase","mb","epoch"} of rank 0 / rank j > 0 of group g;
                        "fenced" once g was declared dead
  shard/{s}/{g}/{j}     digest of rank j's shard after step s     rank j > 0 (the record's digest)
  exit/{g}, nexits      exit code; count of exits                 launcher (it sees processes end)
  weights               JSON {group: speed}, {} = equal           coordinator (detector's speeds)
  nweights, weights/{n} how many times the weights changed        coordinator
  plan/{s}              JSON {"epoch","members","weights"}        CAS, a generation's first step only
  done/{s}/{e}/{g}      JSON {"held": [mb...], "timings": [[tokens, sumsq, seconds]...], "ranks": G}
                        the member's rank 0 ("ranks" where its G > 1 ranks time themselves; the
                        step record sums them)
  done/{s}/{e}/{g}.{j}  JSON {"held": [mb...], "seconds": [s...]}: rank j > 0's own device seconds
  ndone/{s}/{e}         counter                                   member
  decision/{s}/{e}      "commit:{g}:{plan of s+1}" | "retry:{g}"  CAS by the proposer g
  recorded/{s}          "1" once step s's record is written       its writer (with last_commit)
  last_commit           last committed step whose record is out   the record's writer
  reclaim/{s}           a survivor that writes it instead         CAS (the proposer died first)
  eval/{s}/{i}          JSON [loss x tokens, tokens, group]: evaluation microbatch i of the parameters
                        committed after step s                     whoever computed it (equal values)
  evaled/{s}            the group that writes step s's `eval` record   CAS
  finished/{g}, nfinished   a member applied the last step; their count       member
  failed                JSON {"reason","last_committed_step"}     coordinator: every group lost
  pg/{shard}/{e}/{m}/... gloo's rendezvous of epoch e's group of members m (dot-joined) for shard index
                        `shard`
  join/{g}              JSON {"nonce", "restart"}: a restarted or new group g asks to join   its rank 0
  admitted/{g}/{nonce}  the epoch that admitted that request        coordinator
  joined/{g}            the epoch that admitted g last              coordinator
  heal/{g}/{E}          JSON {"step", "donor", "plan"}: the donor of g (admitted in E) sends the state
                        after `step`; g trains from step + 1 under `plan`   the donor's rank 0
  heal/{g}/{E}/pg/{d}/{j}/  gloo's rendezvous of donor d's and g's rank j
  signature             sha256 of the config and the model's parameter names, shapes and dtypes: the
                        first group's; another is refused          every group's rank 0 (CAS)
  restore/...           gloo's rendezvous of a restore from snapshots
  check/{s}/{g}/{j}     digest of group g's shard j (parameters and optimizer state) after step s, for
                        the state agreement check          rank j of g (trainer/agreement.py)
  check/{s}/{g}/{j}/pg/ gloo's rendezvous of the heal of g's rank j after the check of step s
  suspect/{g}.{j}       counter: times group g's rank j was found wrong (corrupted)   the healed rank
  gradcheck/{s}/{i}/{g} digest of microbatch i's gradient in step s as group g computed it (its owner or
                        a checker: trainer/recompute.py)
Unprefixed (they outlive generations):
  config, run_dir, run_id   the run's config (JSON), directory and id   a standalone coordinator, for
                        workers started by torchrun on other hosts (on etcd every coordinator claims
                        `config` by compare-and-set; `run_id` is written last, once the run is set up)
  generation, shutdown  the launcher's orders to the coordinator; with standalone coordinators on etcd,
                        `shutdown` is JSON {"error"} once the run is over   its last leader
  coordinator/leader    the leading coordinator's identity, on its lease (etcd)   election.py
  status/view           the run's latest figures (JSON) for `unbroken status`   the coordinator
  wakes, wake/{n}       the coordinator's wake-ups                launcher
  fired/{i}             fault i of the fault spec fired once      the replica that fired it
  unbroken/snap/{run}/...   the snapshot agents' control plane (`SnapshotKeys`)
Not a key of the protocol: an etcd store keeps one add token per client (`\x00adds/...`, store/etcd.py).
In torchrun's own agent store (one per replica group), not the coordinator's:
  unbroken/attempt{n}/...   the group's process group rendezvous of restart attempt n
"""
from __future__ import annotations

# -- the generation's membership and liveness ----------------------------------------------------------


def generation_prefix(generation: int) -> str:
    return f"g{generation}/"


def epoch() -> str:
    return "epoch"


def members(epoch: int) -> str:
    return f"members/{epoch}"


def epoch_begun(epoch: int) -> str:
    return f"epochs/{epoch}"


def dead(group: int) -> str:
    return f"dead/{group}"


def reform(epoch: int) -> str:
    return f"reform/{epoch}"


def heartbeat(group: int, rank: int = 0) -> str:
    return f"hb/{group}" if rank == 0 else f"hb/{group}.{rank}"


def attempt_prefix(restart: int, job: str = "") -> str:
    """The prefix of a replica group's own rendezvous in torchrun's agent store, per restart attempt: a
    restarted group must not meet the keys of the attempt before. `job` (torchrun's rendezvous id) keeps
    groups apart where their agents share one store (a c10d rendezvous on the coordinator's store)."""
    return f"unbroken/{job}/attempt{restart}" if job else f"unbroken/attempt{restart}"


def group_store_port(group: int, job: str, master: str) -> str:
    """Where the rank 0 of group `group`'s rendezvous round `master` ("MASTER_ADDR:MASTER_PORT" as torchrun
    gave it; `job` its rendezvous id) serves its workers' store, when its agent does not share one: the
    port it bound (intra_group). One key per round, written once by that rank 0, in the coordinator's store."""
    return f"group_store/{group}/{job}/{master}"


def shard_digest(step: int, group: int, rank: int) -> str:
    return f"shard/{step}/{group}/{rank}"


def exited(group: int) -> str:
    return f"exit/{group}"


def exits() -> str:
    return "nexits"


def weights() -> str:
    return "weights"


def weights_version() -> str:
    return "nweights"


def weights_changed(n: int) -> str:
    return f"weights/{n}"


def shrunk() -> str:
    """{group: its plan} of the groups the coordinator shrank and has not seen back at their full plan
    (JSON, written by the leading coordinator only): what a coordinator taking over cannot read off the
    weights."""
    return "shrunk"


def failed() -> str:
    return "failed"


# -- the step -----------------------------------------------------------------------------------------


def plan(step: int) -> str:
    return f"plan/{step}"


def done(step: int, epoch: int, group: int) -> str:
    return f"done/{step}/{epoch}/{group}"


def rank_done(step: int, epoch: int, group: int, rank: int) -> str:
    """Rank j > 0's own device seconds of the microbatches its group computed in (step, epoch)."""
    return f"done/{step}/{epoch}/{group}.{rank}"


def done_count(step: int, epoch: int) -> str:
    return f"ndone/{step}/{epoch}"


def decision(step: int, epoch: int) -> str:
    """The single commit/retry decision of (step, epoch) (coordination.Decision)."""
    return f"decision/{step}/{epoch}"


def recorded(step: int) -> str:
    return f"recorded/{step}"


def last_commit() -> str:
    return "last_commit"


def eval_result(step: int, i: int) -> str:
    return f"eval/{step}/{i}"


def eval_recorder(step: int) -> str:
    return f"evaled/{step}"


def reclaim(step: int) -> str:
    return f"reclaim/{step}"


def finished(group: int) -> str:
    return f"finished/{group}"


def finished_count() -> str:
    return "nfinished"


def collective_prefix(shard: int, epoch: int, members: tuple[int, ...] = ()) -> str:
    """Where epoch `epoch`'s cross-group collective of `members` for shard index `shard` rendezvous (a
    step in flight when a group is admitted reduces in the new epoch without it, the next step with it)."""
    return f"pg/{shard}/{epoch}/{'.'.join(map(str, members))}/"


def join(group: int) -> str:
    return f"join/{group}"


def admitted(group: int, nonce: str) -> str:
    return f"admitted/{group}/{nonce}"


def joined(group: int) -> str:
    return f"joined/{group}"


def standin(group: int, incarnation: str) -> str:
    """Counter: the survivors of `group`'s incarnation (its last admission epoch, or "start") that claimed
    to go on; the first claim (1) asks the coordinator for all of them (replan_reform.agree)."""
    return f"standin/{group}/{incarnation}"


def survivor(group: int, incarnation: str, rank: int) -> str:
    """Set by rank `rank` of `group`'s incarnation when it claims (`standin`): the survivors the first
    claimant names to the coordinator's scheduler."""
    return f"standin/{group}/{incarnation}/rank{rank}"


def heal(group: int, epoch: int) -> str:
    return f"heal/{group}/{epoch}"


def heal_failed(group: int, epoch: int) -> str:
    """Set by a donor rank whose heal of `group` (admitted in `epoch`) failed: its sibling ranks give up too."""
    return f"heal/{group}/{epoch}/failed"


def healed(group: int, epoch: int, rank: int) -> str:
    """A joiner rank's report once every heal of its admission in `epoch` is done: {"bytes", "t" (its
    time.time())}, for the coordinator's measured re-plan cost (coordinator/replan_measure.py)."""
    return f"heal/{group}/{epoch}/done/{rank}"


def reform_prefix(group: int, epoch: int) -> str:
    """Where the ranks of `group`'s shrunk plan admitted in `epoch` form their new process group."""
    return f"regroup/{group}/{epoch}/"


def heal_prefix(group: int, epoch: int, donor: int, shard: int) -> str:
    """Where donor `donor`'s rank `shard` and the joiner's rank `shard` form their two-rank group."""
    return f"heal/{group}/{epoch}/pg/{donor}/{shard}/"


def signature() -> str:
    return "signature"


def restore_prefix(generation: int, shard: int = 0) -> str:
    """Where the gloo group of generation `generation`'s restore from snapshots rendezvous: rank `shard`
    of every replica group (one group per shard index; one-rank groups: shard 0)."""
    return f"restore/{generation}/{shard}/"


# -- unprefixed: the launcher's, across generations ---------------------------------------------------


def generation() -> str:
    return "generation"


def status() -> str:
    return "status/view"


def config() -> str:
    return "config"


def run_dir() -> str:
    return "run_dir"


def run_id() -> str:
    return "run_id"


def shutdown() -> str:
    return "shutdown"


def leader() -> str:
    """The leading coordinator's identity, attached to its etcd lease (election.py): gone when it lapses."""
    return "coordinator/leader"


def wakes() -> str:
    return "wakes"


def wake(n: int) -> str:
    return f"wake/{n}"


def fired(fault: int) -> str:
    return f"fired/{fault}"


def state_check(step: int, group: int, shard: int) -> str:
    """Group `group`'s digest of shard index `shard` (parameters and optimizer state) after `step`."""
    return f"check/{step}/{group}/{shard}"


def state_heal_prefix(step: int, group: int, shard: int) -> str:
    """Where the donor's rank `shard` and corrupted group `group`'s form their two-rank heal group."""
    return f"check/{step}/{group}/{shard}/pg/"


def grad_check(step: int, microbatch: int, group: int) -> str:
    """Group `group`'s digest of microbatch `microbatch`'s gradient in `step` (recomputed ones only)."""
    return f"gradcheck/{step}/{microbatch}/{group}"


def suspect(group: int, rank: int) -> str:
    """How many times (a counter) group `group`'s rank `rank` was found holding corrupted state."""
    return f"suspect/{group}.{rank}"


# -- the snapshot agents' control plane ---------------------------------------------------------------

class SnapshotKeys:
    """Keys under `unbroken/snap/{run_id}/` (snapshot/control.py describes the protocol):
    `SnapshotKeys(run).agent(3)` is `unbroken/snap/{run}/agent/3`; any attribute names a key family."""

    def __init__(self, run_id: str) -> None:  # checked by the caller (snapshot.shm.check_run_id)
        self.base = f"unbroken/snap/{run_id}"

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *parts: "/".join([self.base, name, *map(str, parts)])
