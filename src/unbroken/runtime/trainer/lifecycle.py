"""A trainer process from start to exit code: its phases, and what each outcome means.

Owns: the process's one life as a sequence of phases, each a function whose objects end with its scope:
  start-up    the placement (placement.py) and this rank's identity, read once; bad input is exit 2
  connection  the store, the epoch and decision watches, heartbeats and the fault injector (`Connection`)
  admission   the group's process group, whether it joins a running job, the signature check, the build,
              a restore or a heal (admission.py)
  training    `Trainer.fit` (step.py) until the last step
and the typed outcome each incarnation ends with (`Outcome`), mapped to the exit code in one place
(`exit_code`). A survivor of a group that lost a rank under parallel.on_rank_loss=replan ends its
incarnation `Shrunk` and `run` starts the next one as its place in the shrunk plan: a loop, not a
recursion. Does not own: the step (step.py), building or healing (admission.py), the re-formed group's
plan (replan_reform.py).

Exit codes: 0 done, 1 failed, 2 bad input or a joiner refused (one line on stderr), 3 fenced (declared
dead), 4 its replica group's process group broke under it (a peer rank died; the group leaves the run).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed import DistNetworkError, PrefixStore

from unbroken.config import ConfigError
from unbroken.events import EventLog
from unbroken.faultspec import parse
from unbroken.runtime.parallel.collectives import keep
from unbroken.runtime.parallel.crossgroup import choose, describe
from unbroken.runtime.parallel.device import backend, bind, exact_kernels, hostid_per_rank, nccl_environment, resolve
from unbroken.runtime.parallel.netif import bind_gloo_interface
from unbroken.runtime.parallel.parallelize import intra_group, outlive_agent_restart, peer_lost, release_agent
from unbroken.runtime.parallel.sockets import shut_recorded
from unbroken.runtime.persist.persistence import Persistence
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import connect
from unbroken.runtime.store.reasons import BROKE, evicted, lost_rank
from unbroken.runtime.store.watch import DecisionWatch, EpochWatch, WeightsWatch
from unbroken.runtime.trainer.cutoff import cut_off, say_cut_off
from unbroken.runtime.trainer.admission import agree, build, build_standin, join, signature
from unbroken.runtime.trainer.faults import Injector
from unbroken.runtime.trainer.heartbeat import Beats, FenceLatch, Heartbeat
from unbroken.runtime.trainer.membership import Coordination, FencedOut, GroupLost
from unbroken.runtime.trainer.placement import Factories, Placement, default_factories, placement
from unbroken.runtime.trainer.replan_reform import Reform, agree as agree_on_plan, build as build_reformed
from unbroken.runtime.trainer.replan_reform import regroup, stale_parameters
from unbroken.runtime.parallel.precision import recomputed_blocks
from unbroken.runtime.trainer.step import Trainer
from unbroken.runtime.trainer.stepwork import Parts
from unbroken.topology import Identity, TopologyError

# A survivor waits this long for its sidecar's running job (a store round trip and a digest, ms) before
# it drops its stage; a longer one (rank 0's wait for a dead rank's shard digest) is left, and said.
# Not a config key: a bound far above what the job takes, and nothing a run's setting would change.
SIDECAR_CLOSE_S = 2.0


# -- outcomes: how an incarnation ends ------------------------------------------------------------------

@dataclass(frozen=True)
class Done:
    """Trained to the last step."""


@dataclass(frozen=True)
class Failed:
    """A bug or an unexpected error in this rank (its traceback is on stderr)."""
    why: str


@dataclass(frozen=True)
class Refused:
    """Bad input at the start, or a joiner whose config or model differs from the run's."""
    why: str


@dataclass(frozen=True)
class Fenced:
    """Declared dead: this process must write nothing into a later step."""
    why: str


@dataclass(frozen=True)
class Left:
    """Its group's process group broke (a peer rank died), or its group's shrunk plan runs without it."""
    why: str


@dataclass(frozen=True)
class Incarnation:
    """Who this process trains as: its identity and, for a survivor going on in a shrunk plan, the rank
    it was (`lost_from`) and its place in that plan (`reform`: replan_reform.py)."""
    who: Identity
    lost_from: int = -1
    reform: Reform | None = None

    @property
    def shrunk(self) -> bool:
        return self.lost_from >= 0


@dataclass(frozen=True)
class Shrunk:
    """Its group lost a rank and the coordinator's scheduler gave this survivor a place in a shrunk plan."""
    next: Incarnation


Outcome = Done | Failed | Refused | Fenced | Left | Shrunk


def exit_code(outcome: Outcome) -> int:
    """The process's exit code for an incarnation's final outcome (never `Shrunk`: `run` goes on)."""
    match outcome:
        case Done():
            return 0
        case Failed():
            return 1
        case Refused():
            return 2
        case Fenced():
            return 3
        case Left():
            return 4
    raise ValueError(f"no exit code for {outcome!r}")


# -- start-up ------------------------------------------------------------------------------------------

def run(factories: Factories) -> int:
    """Run this process as replica UNBROKEN_REPLICA until the last step; returns the exit code. Call once
    per process."""
    try:
        where, who = start_up()
    except (ConfigError, TopologyError) as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return exit_code(Refused(str(e)))
    log = EventLog(where.run_dir / "events.jsonl", who=f"replica{who.group}")
    if who.rank == 0:  # the group's process to `kill -9` (under torchrun the launcher only knows the agent's)
        (where.run_dir / "logs").mkdir(exist_ok=True)
        (where.run_dir / "logs" / f"replica{who.group}.pid").write_text(str(os.getpid()))
    log.emit("worker_start", replica=who.group, rank=who.rank, group_size=who.group_size, node=who.node,
             pid=os.getpid(), torchrun="TORCHELASTIC_RUN_ID" in os.environ,
             forked=os.environ.get("UNBROKEN_FORKED", ""),  # "server", "agent" or "" (a fresh interpreter)
             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
             interface=os.environ.get("GLOO_SOCKET_IFNAME", ""),  # what its gloo groups bind
             born=born(),  # the process's start: worker_start's t less it is its imports and set-up
             **describe(where.device, where.cfg.parallel.cross_backend))  # what it computes and reduces on
    # Each incarnation's connection outlives it, as the process does: its store clients and watch
    # threads stay open (a survivor's next incarnation opens its own).
    connections: list[Connection] = []
    me = Incarnation(who)
    while True:
        outcome = serve(where, me, log, factories, connections)
        if not isinstance(outcome, Shrunk):
            return exit_code(outcome)
        me = outcome.next


def born() -> float | None:
    """When this process started (time.time() seconds; a forked worker: its fork), from /proc: the
    starttime field of /proc/self/stat (clock ticks after boot) against /proc/uptime; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(time.time() - (up - ticks / os.sysconf("SC_CLK_TCK")), 3)


def start_up() -> tuple[Placement, Identity]:
    """This process's placement and identity, its device bound before any group or CUDA tensor exists.
    Raises ConfigError or TopologyError (bad input, one line)."""
    where = placement()
    bind_gloo_interface(where.address, os.environ)  # before any gloo group: the coordinator's interface
    who = Identity.from_env(os.environ, where.cfg.topology())
    if not 0 <= who.group < where.cfg.run.replicas:
        raise ConfigError(f"--group {who.group}: the run has replica groups 0..{where.cfg.run.replicas - 1}")
    hostid_per_rank(os.environ, who.group, who.rank)  # before any NCCL call: ranks sharing a GPU
    device = bind(resolve(where.cfg.parallel.device), os.environ)
    choose(where.cfg.parallel.cross_backend, device)  # ConfigError: nccl on a rank that is not on CUDA
    if device.type == "cuda":
        nccl_environment(os.environ)
        if where.cfg.run.exact:
            exact_kernels(device)  # a redone microbatch's gradient: the same bits on any replica
    return replace(where, device=str(device)), who


# -- connection ----------------------------------------------------------------------------------------

@dataclass
class Connection:
    """What an incarnation talks to the coordinator through; built once per incarnation (`connection`)."""
    client: Callable[[], PrefixStore]  # a store client of its own, for each thread and each epoch's group
    raw: object  # the store without the generation's prefix (faults, snapshots)
    watch: EpochWatch
    coord: Coordination
    heartbeat: Heartbeat | Beats
    injector: Injector
    restart: int  # torchrun's restart count of this process
    joining: bool  # this rank's own view: it joins a running job (the group agrees in `admit`)
    tag: dict = field(default_factory=dict)  # on this rank's events


def connection(where: Placement, me: Incarnation, log: EventLog) -> Connection:
    """Connect to the store, start watching it, and make (not start) the heartbeats and the injector."""
    cfg, who, group_id = where.cfg, me.who, me.who.group
    raw = connect(where.address)

    def client() -> PrefixStore:
        return PrefixStore(keys.generation_prefix(where.generation), connect(where.address))

    watch = EpochWatch(client(), reconnect=client)
    coord = Coordination(PrefixStore(keys.generation_prefix(where.generation), raw), group_id, watch,
                         reconnect=client, decisions=DecisionWatch(client(), watch.cond, reconnect=client),
                         rank=who.rank)
    tag = {"rank": who.rank} if who.group_size > 1 else {}
    replan = cfg.parallel.on_rank_loss == "replan"
    shrinkable = replan and who.group_size > 1 and not me.shrunk
    holds = (me.reform.held or range(cfg.parallel.group_size)) if me.shrunk else (who.rank,)  # it beats for
    latch = FenceLatch()  # the process leaves as fenced once, whoever sees the verdict first
    beats = [Heartbeat(where.address, group_id, cfg.coord.heartbeat_interval,
                       on_fenced=lambda why: (log.emit("fenced", replica=group_id, reason=why, **tag),
                                              say_cut_off(group_id, why),
                                              release_agent(replan, evicted(why, who.rank))),
                       prefix=keys.generation_prefix(where.generation), rank=j,
                       # declared dead for another rank's silence: the trainer (fence) decides
                       spared=(lambda why: lost_rank(why) not in (None, who.rank)) if shrinkable else None,
                       latch=latch, give_up_s=cfg.coord.heartbeat_timeout,
                       cut_off_s=cfg.coord.progress_timeout)
             for j in holds]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    faults = parse(cfg.faults.spec, cfg.run.replicas, cfg.run.steps, group_size=cfg.parallel.group_size)
    # a kill takes the rank's own agent too where that agent could not restart it (see faults.Injector)
    injector = Injector(faults, group_id, log, raw, rank=who.rank, sleep_cap_s=cfg.coord.progress_timeout / 4,
                        host=replan and cfg.launch.restarts == 0 and "TORCHELASTIC_RUN_ID" in os.environ)
    # restarted by torchrun, a new process for a lost group, or a lost rank's survivor going on shrunk
    # (or a group admitted before in this generation: its replaced rank's agent re-formed it)
    joining = me.shrunk or restart > 0 or coord.is_dead() or coord.was_admitted()
    return Connection(client, raw, watch, coord, Beats(beats) if me.shrunk else beats[0], injector, restart,
                      joining, tag)


# -- an incarnation: admission, build, training, and what ends it ---------------------------------------

@dataclass
class Built:
    """What an incarnation built, for its release when its group breaks; it dies with `live`'s frame."""
    parts: Parts | None = None
    trainer: Trainer | None = None


@dataclass(frozen=True)
class Broken:
    """Its group broke and this survivor may go on shrunk: it claimed (`leader`: first) and released."""
    leader: bool
    sidecar_idle: bool


def serve(where: Placement, me: Incarnation, log: EventLog, factories: Factories,
          connections: list[Connection]) -> Outcome:
    """One incarnation of this process, from connection to its outcome."""
    conn = connection(where, me, log)
    connections.append(conn)
    ended = live(where, me, conn, log, factories)
    if isinstance(ended, Broken):  # the incarnation's objects are gone with its frame: re-form
        return shrink(where, me, conn, log, ended)
    return ended


def live(where: Placement, me: Incarnation, conn: Connection, log: EventLog,
                factories: Factories) -> Outcome | Broken:
    """Admit, build and train; the errors that end it sorted into outcomes. Returns `Broken` where the
    group broke and this survivor asks to go on shrunk, after releasing what it built."""
    built, group_id = Built(), me.who.group
    try:
        train(where, me, conn, log, factories, built)
    except FencedOut as e:
        conn.heartbeat.stop()
        return Fenced(str(e))
    except GroupLost as e:  # another rank of the group went silent and the group was declared dead
        log.emit("group_broken", replica=group_id, error=f"declared dead: {e}"[:300], **conn.tag)
        conn.heartbeat.stop()
    except DistNetworkError as e:  # a connection broke: the store's (cut off, or declared dead meanwhile)?
        why = cut_off(where, e, conn, log, group_id)
        ended = None if why is None else Fenced(why)
        if ended is None:
            ended = broken_group(where, me, conn, log, e)
        if ended is not None:
            return ended
    except ConfigError as e:  # a joiner refused leaves the run as it was; at the start it is bad input
        print(f"unbroken: error: {e}", file=sys.stderr)
        log.emit("join_refused" if conn.joining else "worker_error", replica=group_id, error=str(e)[:300],
                 **conn.tag)
        return Refused(str(e))
    except Exception as e:  # one line in the log and a non-zero exit; the traceback goes to stderr
        ended = broken_group(where, me, conn, log, e)
        if ended is not None:
            return ended
    else:
        conn.heartbeat.stop()
        log.emit("worker_done", replica=group_id, **conn.tag)
        return Done()
    return release(conn, built)  # outside the except: its traceback would keep the old stage alive


def train(where: Placement, me: Incarnation, conn: Connection, log: EventLog, factories: Factories,
          built: Built) -> None:
    """The incarnation's work: its group's process group, admission, build, restore or heal, then every
    step. Raises what ends it early (`live` sorts it)."""
    cfg, who, coord = where.cfg, me.who, conn.coord
    device = torch.device(where.device)
    if me.shrunk and me.reform.size > 1:
        began = time.monotonic()
        regroup(coord, who, me.reform, backend(device), cfg.coord.collective_timeout)
        log.emit("regroup", replica=who.group, rank=who.rank, stages=me.reform.stages, tp=me.reform.tp,
                 shards=list(me.reform.held), seconds=round(time.monotonic() - began, 6))
    group = (dist.group.WORLD if me.reform.size > 1 else None) if me.shrunk else \
        intra_group(who.group_size, cfg.coord.collective_timeout, backend=backend(device), device=device,
                    relay=coord.store, me=who.group)
    conn.joining, nonce = agree(group, conn.joining, conn.restart, who.group)
    if conn.joining and not me.shrunk and who.rank == 0 and not coord.is_dead():
        # torchrun stopped every process of this group before it started us: the coordinator need not
        # wait out the old ones' heartbeats (a stand-in still starting is given 120 s of them)
        coord.leave("its ranks were restarted by torchrun")
    if not conn.joining:
        conn.heartbeat.start()
    built.parts = parts = (build_reformed(cfg, factories, me.reform, device) if me.reform.size > 1 else
                           build_standin(cfg, factories, device)) if me.shrunk else \
        build(cfg, factories, who, group, device)
    if parts.applied:  # a group of several ranks at its full plan: what its plan (or function) applied here
        log.emit("parallelized", replica=who.group, **parts.applied, **conn.tag)
    if cfg.model.activation_checkpointing != "none":  # which of its blocks this rank recomputes, as built
        log.emit("checkpointing", replica=who.group, mode=cfg.model.activation_checkpointing,
                 blocks=recomputed_blocks(parts.model, factories.plan_of(parts.model)), **conn.tag)
    mine = signature(cfg, parts)
    if who.rank == 0 and not me.shrunk and coord.claim_signature(mine) != mine:
        raise ConfigError(f"replica group {who.group}'s config or model differs from the run's (signature "
                          f"{mine[:12]}...): refused, nothing loaded")
    persist = None
    if cfg.snapshot.enabled or cfg.checkpoint.every:
        persist = Persistence(cfg, who.group, conn.raw, where.run_id, where.run_dir, parts.model,
                              parts.optimizer, log, who.rank)
    sidecar = Coordination(conn.client(), who.group, conn.watch,
                           weights=WeightsWatch(conn.client(), reconnect=conn.client), rank=who.rank)
    built.trainer = trainer = Trainer(cfg, who, parts, coord, log, conn.heartbeat, conn.injector, sidecar, persist,
                                      factories.lr_schedule)
    first, plan = starting_step(where, me, conn, log, parts, trainer, nonce)
    trainer.fit(first, plan)
    if trainer.persist:
        trainer.persist.close()
    coord.finish()


def starting_step(where: Placement, me: Incarnation, conn: Connection, log: EventLog, parts: Parts,
                  trainer: Trainer, nonce: str) -> tuple[int, object]:
    """The first step this incarnation trains and its plan (None: agreed at that step): 0, the step after
    a restore (a whole-job restart) or after the heal that admits a joiner."""
    limit = int(os.environ.get("UNBROKEN_RESTORE_MAX", "-1"))
    first = trainer.persist.resume(where.resume, where.generation, limit if limit >= 0 else None) \
        if where.resume and trainer.persist else 0
    if not conn.joining:
        return first, None
    return join(where.cfg, me.who, conn.coord, conn.heartbeat, parts, log, conn.restart, nonce,
                me.reform.admitted if me.shrunk else None)


def broken_group(where: Placement, me: Incarnation, conn: Connection, log: EventLog,
                 error: Exception) -> Outcome | None:
    """The outcome of an error that ended the incarnation, or None where its group's process group broke
    under it (a peer rank died) and this survivor goes on shrunk (parallel.on_rank_loss=replan)."""
    cfg, who, coord = where.cfg, me.who, conn.coord
    if not (who.group_size > 1 and (not me.shrunk or me.reform.size > 1) and peer_lost(error)):
        traceback.print_exc()
        log.emit("worker_error", replica=who.group, error=f"{type(error).__name__}: {error}"[:300], **conn.tag)
        return Failed(f"{type(error).__name__}: {error}")
    # A rank of our group died (of a re-formed one too: torchrun stopping a peer for a grow back): the
    # group is out, not the run.
    replan = cfg.parallel.on_rank_loss == "replan"
    conn.heartbeat.stop()  # before the coordinator's fence mark could end this process
    dead = coord.dead_reason() if replan and who.group_size > 1 and not me.shrunk else None
    # The rank its group was declared dead for (evicted as slow): its peers broke the group leaving to go
    # on without it, before its own fence read the verdict. Claiming, it would be counted alive and the
    # plan would keep it.
    ousted = dead is not None and lost_rank(dead) == who.rank
    if not ousted and not coord.superseded():  # the coordinator learns now, not after a heartbeat timeout;
        # before the traceback and the event, since torchrun's SIGTERM to this rank may follow within ms
        coord.leave(BROKE if replan else 4)
    traceback.print_exc()
    log.emit("group_broken", replica=who.group, error=f"{type(error).__name__}: {error}"[:300], **conn.tag)
    if ousted:
        if conn.heartbeat.latch.claim():
            log.emit("fenced", replica=who.group, reason=dead, **conn.tag)
            release_agent(replan, evicted(dead, who.rank))
        return Fenced(dead)
    if not replan or me.shrunk:  # a re-formed group does not re-form again: it grows back
        outlive_agent_restart(replan and me.shrunk)
        return Left("its group's process group broke")
    return None


def release(conn: Connection, built: Built) -> Broken:
    """A survivor's claim, then what its broken incarnation holds: the pipeline an interrupted schedule
    kept alive, the cross-group groups (kept: collectives.keep), the sidecar's running job."""
    leader = conn.coord.claim_standin()  # first, so the first survivor to claim sees the others' claims
    # Its stage's model, optimizer state and pipeline go before the whole model is built: on a GPU that
    # is one stage's weights and Adam moments too many (`released` counts what still holds on).
    if built.parts is not None and built.parts.stages is not None:
        built.parts.stages.close()
    idle = True  # the sidecar's running job holds the trainer through its digest: it ends first
    if built.trainer is not None:
        keep(list(built.trainer.groups.values()))
        idle = built.trainer.sidecar.close(SIDECAR_CLOSE_S)
    return Broken(leader, idle)


def shrink(where: Placement, me: Incarnation, conn: Connection, log: EventLog, broken: Broken) -> Outcome:
    """After the broken incarnation let go of its objects: close its group, agree on the plan the
    coordinator chose for the survivors, and take a place in it (`Shrunk`) or leave."""
    cfg, who = where.cfg, me.who
    shut = close_group()  # a peer blocked on this rank wakes, and claims in time
    log.emit("released", replica=who.group, **conn.tag, **stale_parameters(), sockets_shut=shut,
             sidecar_idle=broken.sidecar_idle)
    place = agree_on_plan(cfg, conn.coord, who, broken.leader, conn.restart, conn.coord.incarnation,
                          cfg.coord.startup_timeout)
    if isinstance(place, str):  # the group dropped, or its plan runs on the other survivors
        event, fields = ("shrink_refused", {"alive": [who.rank]}) if place == "refused" else \
            ("survivor_left", {"why": "its group's shrunk plan runs on other survivors", **conn.tag})
        log.emit(event, replica=who.group, **fields)
        release_agent(cfg.parallel.on_rank_loss == "replan")
        return Left(place)
    size = place.size if place.size > 1 else who.group_size
    return Shrunk(Incarnation(Identity(who.group, place.rank, size, who.node), lost_from=who.rank, reform=place))


def close_group() -> int:
    """Shut the broken group's sockets (sockets.py), then destroy its process groups (the default one, its
    mesh's sub-groups); the number of sockets shut. Why: a peer blocked in a receive from this rank
    (stage 0's, waiting on stage 1's survivor) wakes only when this rank's socket closes, and nothing this
    rank can drop closes it (a pending receive on gloo's thread holds the group); left blocked, the peer
    would miss the first survivor's claim window (parallel.claim_wait) and never claim. Call once per
    survivor, after dropping what it held of the group, before it claims."""
    shut = shut_recorded()
    if dist.is_initialized():
        dist.destroy_process_group()
    return shut


def main(argv: list[str] | None = None, exit: Callable[[int], None] = os._exit) -> None:
    """`python -m unbroken.runtime.trainer [--coordinator HOST:PORT --group R]`: without flags, the local
    launcher's environment says where to run. Ends the process by `exit(code)`, which must skip
    destructors (`os._exit`; a rank that forkrun forked hands its result to the agent first)."""
    import argparse

    ap = argparse.ArgumentParser(prog="unbroken worker")
    ap.add_argument("--coordinator", help="host:port that `unbroken coordinator` printed, or its etcd://... store")
    ap.add_argument("--group", type=int, help="this torchrun job's replica group id (0 .. replicas-1)")
    a = ap.parse_args(argv)
    if (a.coordinator is None) != (a.group is None):
        print("unbroken: error: --coordinator and --group go together", file=sys.stderr)
        os._exit(2)
    if a.coordinator is not None:
        os.environ["UNBROKEN_COORDINATOR"], os.environ["UNBROKEN_REPLICA"] = a.coordinator, str(a.group)
    code = run(default_factories())
    sys.stdout.flush()
    sys.stderr.flush()
    exit(code)  # skip destructors of abandoned gloo groups, which could block on dead peers


if __name__ == "__main__":
    main()
