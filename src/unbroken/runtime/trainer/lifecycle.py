"""The worker entry point: one replica process, started by the launcher (or by torchrun on a cluster).

Owns: reading the process environment once (this process's `Identity`), connecting to the coordinator,
building the model, data and optimizer from the factories (the model through `parallelize`: the model as
this rank holds it), the trainer and its persistence, and leaving with a meaningful exit code. Does not
own: the step loop (trainer.py).

Two ways in, one process. Under the local launcher, the environment (launch.py sets it):
  UNBROKEN_STORE=host:port   the coordinator's TCPStore (or etcd://...: the run's etcd store)
  UNBROKEN_REPLICA=r         this replica group's id
  UNBROKEN_RUN_DIR=DIR       where events.jsonl and config.json live
  UNBROKEN_GENERATION=g      whole-job restarts so far: coordination keys live under g{g}/
  UNBROKEN_RESUME=memory|disk|scratch   a restarted trainer's restore source (empty: a fresh start)
  UNBROKEN_RESTORE_MAX=s     ... and the newest step it may restore (the log's last recorded step)
  UNBROKEN_RUN_ID=id         names the run's snapshots and checkpoints
On a cluster, one torchrun job per replica group (docs/cluster.md):
  torchrun --standalone --nproc-per-node=1 -m unbroken.runtime.trainer --coordinator HOST:PORT --group R
(or UNBROKEN_COORDINATOR=HOST:PORT and UNBROKEN_REPLICA=R in the environment, for a user's script that
calls `unbroken.train(...)`; `--coordinator etcd://h1:2379,...[/namespace]` when the coordinators keep
the run in etcd: the worker then follows whichever of them leads, as it talks only to the store):
the config, run directory and run id come from the coordinator's store;
torchrun's RANK and WORLD_SIZE give the rank inside the group.
Run with the default GPT and corpus as `python -m unbroken.runtime.trainer`; a user's script that calls
`unbroken.train(...)` is re-run as the worker with its own factories instead.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import DistStoreError, PrefixStore

from unbroken.config import Config, ConfigError, store_url_problem
from unbroken.events import EventLog
from unbroken.faultspec import parse
from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination, GroupLost
from unbroken.runtime.store.reasons import BROKE, evicted, lost_rank
from unbroken.runtime.store.client import answering, connect, read
from unbroken.runtime.store.watch import DecisionWatch, EpochWatch, WeightsWatch
from unbroken.runtime.trainer.faults import Injector
from unbroken.runtime.trainer.heartbeat import Beats, Heartbeat
from unbroken.policy.membership import donor
from unbroken.runtime.persist.healing import Forming, receive
from unbroken.runtime.persist.state import materialize
from unbroken.runtime.persist.persistence import Persistence
from unbroken.runtime.parallel.accumulator import unique_parameters
from unbroken.runtime.parallel.collectives import keep
from unbroken.runtime.parallel.device import backend, bind, exact_kernels, nccl_environment, resolve
from unbroken.runtime.parallel.parallelize import (intra_group, outlive_agent_restart, parallelize, peer_lost,
                                                      release_agent)
from unbroken.runtime.parallel.sockets import shut_recorded
from unbroken.runtime.parallel.standin import StandIn
from unbroken.runtime.trainer.replan_reform import Reform, agree as agree_on_plan, build as build_reformed, regroup, stale_parameters
from unbroken.runtime.trainer.stepwork import Parts
from unbroken.runtime.trainer.step import Trainer
from unbroken.topology import Identity, TopologyError

# A survivor waits this long for its sidecar's running job (a store round trip and a digest, ms) before
# it drops its stage; a longer one (rank 0's wait for a dead rank's shard digest) is left, and said
SIDECAR_CLOSE_S = 2.0


@dataclass(frozen=True)
class Factories:
    """What a user brings. Each is called once per trainer process, after the seed is set.

    model(cfg) -> nn.Module whose forward(x, y) returns the mean loss over counted targets;
    data(cfg) -> object with microbatch(step, i) -> (x, y, tokens, sumsq) and step_tokens(step, M);
    optimizer(params, cfg) -> torch.optim.Optimizer.
    """
    model: Callable[[Config], object]
    data: Callable[[Config], object]
    optimizer: Callable[[list, Config], object]


def in_worker() -> bool:
    return "UNBROKEN_REPLICA" in os.environ


@dataclass(frozen=True)
class Placement:
    """Where this trainer process runs: its coordinator, run and restart generation."""
    address: str  # the coordinator's store, host:port
    run_dir: Path
    cfg: Config
    generation: int
    resume: str  # memory | disk | scratch after a whole-job restart; "" for a fresh start
    run_id: str
    device: str = "cpu"  # this rank's torch device, bound (device.bind) once at start-up: "cuda:1"


def answers(address: str, timeout_s: float) -> None:
    """Wait up to `timeout_s` for something to accept connections at host:port (the coordinator may still
    be starting), or for a member of the etcd store at etcd://... to answer. Raises ConfigError, one line:
    a failed TCPStore connect prints a C++ trace instead."""
    if address.startswith("etcd://"):
        problem = store_url_problem(address)
        if problem:
            raise ConfigError(f"--coordinator {address!r}: {problem}")
        answering(address, "--coordinator ", timeout_s)
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator {address!r}: expected host:port")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(f"the coordinator at {address!r} does not answer "
                                  f"(tried for {timeout_s:g} s)") from None
            time.sleep(0.2)


def placement(env: dict[str, str] | None = None) -> Placement:
    """This process's placement: from the local launcher's environment, or (UNBROKEN_COORDINATOR) from the
    coordinator's store. Raises ConfigError (one line) when the coordinator does not answer or serves no
    run; call once, at start-up."""
    env = dict(os.environ if env is None else env)
    if "UNBROKEN_STORE" in env:
        run_dir = Path(env["UNBROKEN_RUN_DIR"])
        return Placement(env["UNBROKEN_STORE"], run_dir, Config.from_json((run_dir / "config.json").read_text()),
                         int(env.get("UNBROKEN_GENERATION", "0")), env.get("UNBROKEN_RESUME", ""),
                         env.get("UNBROKEN_RUN_ID", "run-local"))
    address = env.get("UNBROKEN_COORDINATOR", "")
    answers(address, float(env.get("UNBROKEN_CONNECT_TIMEOUT", "30")))
    store = connect(address)
    if address.startswith("etcd://"):  # coordinators and workers start in any order: the leader may not
        try:                           # have set the run up yet (it writes the run's id last)
            store.wait([keys.run_id()], datetime.timedelta(seconds=float(env.get("UNBROKEN_CONNECT_TIMEOUT", "30"))))
        except DistStoreError:
            pass  # no run there: said below
    values = [read(store, k) for k in (keys.config(), keys.run_dir(), keys.run_id())]
    if None in values:
        raise ConfigError(f"{address!r} serves no unbroken run (start it with `unbroken coordinator`)")
    generation = read(store, keys.generation())
    return Placement(address, Path(values[1].decode()), Config.from_json(values[0].decode()),
                     int(generation or 0), "", values[2].decode())


def default_factories() -> Factories:
    import torch

    from unbroken.model.data import DataSource
    from unbroken.model.gpt import GPT

    def optimizer(params, cfg: Config) -> torch.optim.Optimizer:
        o = cfg.optim
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)

    return Factories(model=lambda cfg: GPT(cfg.model),
                     data=lambda cfg: DataSource(cfg.data, cfg.model.block_size, cfg.run.seed),
                     optimizer=optimizer)


def build(cfg: Config, factories: Factories, who: Identity, group, device=None) -> Parts:
    """The model (as this rank holds it, on `device`: CPU when None), data and optimizer over the replica
    group's own process group (`intra_group`; None for one-rank groups). The thread count is the same on
    every replica, so kernels sum in the same order; the seed makes the initial parameters identical."""
    import torch

    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    device = torch.device("cpu") if device is None else device
    # a stage's microbatch is its FSDP shard's rows (data.part); config: seq_len a number, shards divide B
    topology = cfg.topology()
    shape = (cfg.data.batch_size // topology.dp_shard, int(cfg.data.seq_len)) if topology.pp > 1 else None
    # moved before parallelize: TP and the pipeline stage move only what they split, FSDP2 all of it
    model, stages = parallelize(factories.model(cfg).to(device), topology, group, cfg.run.exact, who.rank,
                                shape, device)
    data = factories.data(cfg)
    return Parts(model, data, factories.optimizer(unique_parameters(model), cfg), group, stages)


def run(factories: Factories) -> int:
    """Run this process as replica UNBROKEN_REPLICA until the last step. Returns the exit code: 0 done,
    1 failed, 2 bad input (one line on stderr), 3 fenced (declared dead), 4 its replica group's process
    group broke under it (a peer rank died; the group leaves the run)."""
    try:
        where = placement()
        who = Identity.from_env(os.environ, where.cfg.topology())
        if not 0 <= who.group < where.cfg.run.replicas:
            raise ConfigError(f"--group {who.group}: the run has replica groups 0..{where.cfg.run.replicas - 1}")
        device = bind(resolve(where.cfg.parallel.device), os.environ)  # before any group or CUDA tensor
        if device.type == "cuda":
            nccl_environment(os.environ)
            if where.cfg.run.exact:
                exact_kernels(device)  # a redone microbatch's gradient: the same bits on any replica
        where = replace(where, device=str(device))
    except (ConfigError, TopologyError) as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return 2
    log = EventLog(where.run_dir / "events.jsonl", who=f"replica{who.group}")
    if who.rank == 0:  # the group's process to `kill -9` (under torchrun the launcher only knows the agent's)
        (where.run_dir / "logs").mkdir(exist_ok=True)
        (where.run_dir / "logs" / f"replica{who.group}.pid").write_text(str(os.getpid()))
    log.emit("worker_start", replica=who.group, rank=who.rank, group_size=who.group_size, node=who.node,
             pid=os.getpid(), torchrun="TORCHELASTIC_RUN_ID" in os.environ,
             forked=os.environ.get("UNBROKEN_FORKED", ""),  # "server", "agent" or "" (a fresh interpreter)
             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    return _serve(where, who, log, factories)


def _serve(where: Placement, who: Identity, log: EventLog, factories: Factories, lost_from: int = -1,
           reform: Reform | None = None) -> int:
    """Train as `who` until the last step; the exit code of `run`. `lost_from` >= 0: this process is the
    survivor (then rank `lost_from`) of a group that lost a rank, going on
    as its place in its group's shrunk plan, `reform` (reform.py: one rank standing in for the whole
    group, standin.py, or a stage of a pipeline of merged stages), admitted by the coordinator's scheduler
    (parallel.on_rank_loss=replan)."""
    address, run_dir, cfg, generation = where.address, where.run_dir, where.cfg, where.generation
    resume, run_id, me = where.resume, where.run_id, who.group
    shrinking = lost_from >= 0
    raw = connect(address)

    def client() -> PrefixStore:  # a client of its own for each thread (and each epoch's group)
        return PrefixStore(keys.generation_prefix(generation), connect(address))

    watch = EpochWatch(client(), reconnect=client)
    coord = Coordination(PrefixStore(keys.generation_prefix(generation), raw), me, watch, reconnect=client,
                         decisions=DecisionWatch(client(), watch.cond, reconnect=client), rank=who.rank)
    tag = {"rank": who.rank} if who.group_size > 1 else {}
    holds = (reform.held or range(cfg.parallel.group_size)) if shrinking else (who.rank,)  # the rank indices it beats for
    replan = cfg.parallel.on_rank_loss == "replan"
    shrinkable = replan and who.group_size > 1 and not shrinking
    beats = [Heartbeat(address, me, cfg.coord.heartbeat_interval,
                       on_fenced=lambda why: (log.emit("fenced", replica=me, reason=why, **tag),
                                              release_agent(replan, evicted(why, who.rank))),
                       prefix=keys.generation_prefix(generation), rank=j,
                       # declared dead for another rank's silence: the trainer (fence) decides
                       spared=(lambda why: lost_rank(why) not in (None, who.rank)) if shrinkable else None)
             for j in holds]
    heartbeat = Beats(beats) if shrinking else beats[0]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # restarted by torchrun, a new process for a lost group, or a lost rank's survivor going on shrunk
    # (or a group admitted before in this generation: its replaced rank's agent re-formed it)
    joining = shrinking or restart > 0 or coord.is_dead() or coord.was_admitted()
    go_on = False  # this rank goes on as its shrunk group (after the except below)
    parts = trainer = None
    faults = parse(cfg.run.faults, cfg.run.replicas, cfg.run.steps, group_size=cfg.parallel.group_size)
    # a kill takes the rank's own agent too where that agent could not restart it (see faults.Injector)
    injector = Injector(faults, me, log, raw, rank=who.rank, sleep_cap_s=cfg.coord.progress_timeout / 4,
                        host=replan and cfg.run.restarts == 0
                        and "TORCHELASTIC_RUN_ID" in os.environ)
    try:
        device = torch.device(where.device)
        if shrinking and reform.size > 1:
            began = time.monotonic()
            regroup(coord, who, reform, backend(device), cfg.coord.collective_timeout)
            log.emit("regroup", replica=me, rank=who.rank, stages=reform.stages, tp=reform.tp,
                     shards=list(reform.held), seconds=round(time.monotonic() - began, 6))
        group = (dist.group.WORLD if reform.size > 1 else None) if shrinking else \
            intra_group(who.group_size, cfg.coord.collective_timeout, backend=backend(device), device=device,
                        relay=coord.store, me=me)
        joining, nonce = agree(group, joining, restart, me)
        if joining and not shrinking and who.rank == 0 and not coord.is_dead():
            # torchrun stopped every process of this group before it started us: the coordinator need not
            # wait out the old ones' heartbeats (a stand-in still starting is given 120 s of them)
            coord.leave("its ranks were restarted by torchrun")
        if not joining:
            heartbeat.start()
        parts = (build_reformed(cfg, factories, reform, device) if reform.size > 1 else
                 build_standin(cfg, factories, device)) if shrinking else build(cfg, factories, who, group, device)
        mine = signature(cfg, parts)
        if who.rank == 0 and not shrinking and coord.claim_signature(mine) != mine:
            raise ConfigError(f"replica group {me}'s config or model differs from the run's (signature "
                              f"{mine[:12]}...): refused, nothing loaded")
        persist = None
        if cfg.snapshot.enabled or cfg.checkpoint.every:
            persist = Persistence(cfg, me, raw, run_id, run_dir, parts.model, parts.optimizer, log, who.rank)
        sidecar = Coordination(client(), me, watch, weights=WeightsWatch(client(), reconnect=client), rank=who.rank)
        trainer = Trainer(cfg, who, parts, coord, log, heartbeat, injector, sidecar, persist)
        limit = int(os.environ.get("UNBROKEN_RESTORE_MAX", "-1"))
        first = trainer.persist.resume(resume, generation, limit if limit >= 0 else None) \
            if resume and trainer.persist else 0
        plan = None
        if joining:
            first, plan = join(cfg, who, coord, heartbeat, parts, log, restart, nonce,
                               reform.admitted if shrinking else None)
        trainer.fit(first, plan)
        if trainer.persist:
            trainer.persist.close()
        coord.finish()
    except GroupLost as e:  # another rank of the group went silent and the group was declared dead
        log.emit("group_broken", replica=me, error=f"declared dead: {e}"[:300], **tag)
        heartbeat.stop()
        go_on = True
    except ConfigError as e:  # a joiner refused leaves the run as it was; at the start it is bad input
        print(f"unbroken: error: {e}", file=sys.stderr)
        log.emit("join_refused" if joining else "worker_error", replica=me, error=str(e)[:300], **tag)
        return 2
    except Exception as e:  # one line in the log and a non-zero exit; the traceback goes to stderr
        # a rank of our group died (of a re-formed one too: torchrun stopping a peer for a grow back, CI
        # at 4eebe80, was a worker_error that failed the run): the group is out, not the run
        if who.group_size > 1 and (not shrinking or reform.size > 1) and peer_lost(e):
            heartbeat.stop()  # before the coordinator's fence mark could end this process
            dead = coord.dead_reason() if shrinkable else None
            # the rank its group was declared dead for (evicted as slow): its peers broke the group
            # leaving to go on without it, before its own fence read the verdict. Claiming, it was
            # counted alive and the plan kept it (CI at b0316a2: both refused, the group restarted)
            ousted = dead is not None and lost_rank(dead) == who.rank
            if not ousted and not coord.superseded():  # the coordinator learns now, not after a heartbeat
                # timeout; before the traceback and the event, since torchrun's SIGTERM to this rank may
                # follow within milliseconds (CI at 0cc9587: 5 ms after the event, and the report was lost)
                coord.leave(BROKE if replan else 4)
            traceback.print_exc()
            log.emit("group_broken", replica=me, error=f"{type(e).__name__}: {e}"[:300], **tag)
            if ousted:
                log.emit("fenced", replica=me, reason=dead, **tag)
                release_agent(replan, evicted(dead, who.rank))
                return 3
            if not replan or shrinking:  # a re-formed group does not re-form again: it grows back
                outlive_agent_restart(replan and shrinking)
                return 4
            go_on = True
        else:
            traceback.print_exc()
            log.emit("worker_error", replica=me, error=f"{type(e).__name__}: {e}"[:300], **tag)
            return 1
    if go_on:  # shrunk onto this rank, outside the except: its traceback would keep the old stage alive
        leader = coord.claim_standin()  # first, so the first survivor to claim sees the others' claims
        # Its stage's model, optimizer state and pipeline go before the whole model is built: on a GPU
        # that is one stage's weights and Adam moments too many. `released` counts what still holds on.
        if parts is not None and parts.stages is not None:
            parts.stages.close()  # what an interrupted schedule kept alive
        idle = True  # the sidecar's running job holds the trainer through its digest: it ends first
        if trainer is not None:
            keep(list(trainer.groups.values()))  # the cross-group gloo groups live on (collectives.keep)
            idle = trainer.sidecar.close(SIDECAR_CLOSE_S)
        trainer = parts = persist = sidecar = injector = group = None
        shut = close_group()  # a peer blocked on this rank wakes, and claims in time
        log.emit("released", replica=me, **tag, **stale_parameters(), sockets_shut=shut, sidecar_idle=idle)
        # the survivors agree on the plan the coordinator chose for them: each takes its place or leaves
        place = agree_on_plan(cfg, coord, who, leader, restart, coord.incarnation,
                              cfg.coord.startup_timeout)
        if isinstance(place, str):  # the group dropped, or its plan runs on the other survivors
            event, fields = ("shrink_refused", {"alive": [who.rank]}) if place == "refused" else \
                ("survivor_left", {"why": "its group's shrunk plan runs on other survivors", **tag})
            log.emit(event, replica=me, **fields)
            release_agent(replan)
            return 4
        return _serve(where, Identity(me, place.rank, place.size if place.size > 1 else who.group_size,
                                      who.node), log, factories, lost_from=who.rank, reform=place)
    heartbeat.stop()
    log.emit("worker_done", replica=me, **tag)
    return 0


def close_group() -> int:
    """Shut the broken group's sockets (sockets.py), then destroy its process groups (the default one, its
    mesh's sub-groups); the number of sockets shut. Why: a peer blocked in a receive from this rank
    (stage 0's, waiting on stage 1's survivor) wakes only when this rank's socket closes, and nothing this
    rank can drop closes it (a pending receive on gloo's thread holds the group): it woke only when
    torchrun stopped this survivor for a grow back, past the first survivor's claim window (3 s), and never
    claimed. Call once per survivor, after dropping what it held of the group, before it claims."""
    shut = shut_recorded()
    if dist.is_initialized():
        dist.destroy_process_group()
    return shut


def build_standin(cfg: Config, factories: Factories, device=None) -> Parts:
    """A shrunk group's one rank: the whole model (its state comes from a peer group's ranks by healing, so
    the seed matters only for determinism), every stage's, TP rank's or FSDP2 shard's shard index held
    (standin.py)."""
    import torch

    torch.manual_seed(cfg.run.seed)
    model = factories.model(cfg).to(torch.device("cpu") if device is None else device)
    standin = StandIn(model, cfg.parallel.pp, cfg.parallel.tp, cfg.topology().dp_shard)
    return Parts(model, factories.data(cfg), factories.optimizer(unique_parameters(model), cfg), None, None, standin)


def agree(group, joining: bool, restart: int, me: int) -> tuple[bool, str]:
    """(Whether this group's ranks join a running job, the nonce of their one admission request), the same
    on every rank: rank 0's nonce, and joining if any rank would. Call once per process, after
    `intra_group` and before the heartbeat starts. Neither torchrun's restart count nor a rank's own view
    of the coordinator is common to a group's ranks: a rank its own agent restarted is attempt r + 1, its
    peers, restarted by their agents for the membership change, attempt r, and a peer may look before
    the coordinator has declared the group dead. Raises what a collective of a broken group raises."""
    import secrets

    import torch.distributed as dist

    nonce = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'direct')}-{restart}-{me}-{secrets.token_hex(4)}"
    if group is None:
        return joining, nonce
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (joining, nonce), group=group)
    return any(j for j, _ in views), views[0][1]


def signature(cfg: Config, parts: Parts) -> str:
    """sha256 of the run's config and the model's parameter names, global shapes and dtypes: what every
    group must share (a joiner built from other code or another config is refused before loading)."""
    h = hashlib.sha256(cfg.to_json().encode())
    for name, p in parts.model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()


def join(cfg: Config, who: Identity, coord: Coordination, heartbeat: Heartbeat | Beats, parts: Parts, log: EventLog,
         restart: int, nonce: str, admitted: int | None = None) -> tuple[int, object]:
    """Rejoin a running job: ask for admission (rank 0), wait for it, beat again, then take the state after
    step s from rank j of the donor group that policy.membership chose. Returns (s + 1, the plan of s + 1).
    `admitted`: the epoch that admitted this rank's shrunk group, whose survivors asked before they built
    (reform.agree); it takes each shard index it holds from the donor's ranks, one heal each. Call once, after `build`, before
    training. The admission waits for the old incarnation to be declared dead (a heartbeat timeout, or
    at once after a `leave`) and for a step boundary: up to the start-up timeout."""
    # The optimizer's state tensors to load into, before asking: its one step imports torch._dynamo
    # (~1 CPU-s, AdamW's first step), which done after the request landed in the survivors' steps around
    # the admission on a shared host, the window the rejoin's stall is measured over (benchmarks/rejoin.py).
    materialize(parts.model, parts.optimizer)
    wait, timeout = cfg.coord.startup_timeout, cfg.coord.collective_timeout
    if admitted is None:  # a shrunk group's survivors asked and were admitted before they built (reform.agree)
        if who.rank == 0:
            coord.ask_to_join(nonce, restart)
        admitted = coord.admitted(nonce, wait)
    coord.incarnation = str(admitted)  # its survivors claim a stand-in for this incarnation (claim_standin)
    heartbeat.start()
    standin = parts.standin
    shards = [(j, lambda j=j: standin.heal_tensors(j, parts.optimizer)) for j in standin.held] \
        if standin else [(who.rank, None)]

    def forming(d: int, shard: int) -> Forming:
        return Forming(coord.group_store(), keys.heal_prefix(who.group, admitted, d, shard), 1, timeout)

    # the donor of the step boundary ahead, as the members will pick it if nobody dies meanwhile
    likely = donor([m for m in coord.members(admitted) if m != who.group], who.group)
    early = [forming(likely, j) for j, _ in shards]
    step, chosen, plan = coord.heal_offer(admitted, wait)
    heartbeat.at(step, "heal")
    received = 0
    for (j, shard), ready in zip(shards, early):
        got, seconds, transfer = receive(ready if chosen == likely else forming(chosen, j), parts.model,
                                         parts.optimizer, shard)
        received += got
        log.emit("heal", replica=who.group, donor=chosen, step=step, bytes=got, seconds=round(seconds, 6),
                 transfer=round(transfer, 6), side="joiner",
                 **({"rank": j} if who.group_size > 1 else {}), **({"shrunk": True} if standin else {}))
    coord.report_healed(admitted, who.rank, received)
    return step + 1, plan


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
