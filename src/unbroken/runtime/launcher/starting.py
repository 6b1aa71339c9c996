"""How each process of a local run is started: the coordinator, the trainers' fork server, and each
replica group's worker (a forked trainer, a process, a torchrun job, or a torchrun agent per rank).

Owns: their command lines, the environment a torchrun job per replica group would give them, their log
and pid files, core pinning (launch.pin_cores) and the coordinator's port, held from its choice until the
coordinator serves it. Does not own: when to start or stop them, or what their exits mean (launch.py),
killing them (processes.py).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from unbroken.config import Config
from unbroken.runtime.coordinator.replan import group_shape, plan_arg
from unbroken.runtime.launcher.processes import AgentGroup, start_time
from unbroken.runtime.launcher.zygote import Forked, Zygote

DEFAULT_WORKER = [sys.executable, "-m", "unbroken.runtime.trainer.lifecycle"]  # what `-m unbroken.runtime.trainer` runs
FORKRUN = "unbroken.runtime.trainer.forkrun"  # torchrun, its ranks forked from its agent
COORDINATOR = "unbroken.runtime.coordinator.coordinator"
SNAPSHOT_AGENT = "unbroken.runtime.snapshot.agent"


def _listening() -> socket.socket:
    """A loopback socket on a free port, listening, inheritable by a child; SO_REUSEADDR and the backlog
    as TCPStore's own server sets them (its connections' TIME_WAIT must not block a later server)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    s.set_inheritable(True)
    return s


def hold_port(cfg: Config) -> socket.socket | None:
    """The coordinator's port, chosen and held now (a socket bound and listening, which the coordinator's
    store then serves: `--listen-fd`), so no other process (an outgoing connection's ephemeral port, another
    run) can take it before the coordinator serves it. None where the address is etcd's. Call before
    `fork_server`, which holds it for the forked coordinator; `start_coordinator` closes it here."""
    return None if cfg.coord.store else _listening()


def start_coordinator(cfg: Config, run_dir: Path, n: int = 0, held: socket.socket | None = None,
                      zygote: Zygote | None = None, refused: str | None = None) -> tuple[subprocess.Popen | Forked, str]:
    """Start the coordinator on the port `held` (hold_port; None: one held now, or etcd's address),
    forked by `zygote` where it forks (saving the ~1.5 CPU-s of its imports), else as a fresh interpreter
    while the workers start; their store clients retry until the server is up. n > 0: a standby (etcd).
    `refused`: why the run's groups cannot re-form onto fewer ranks (replan.GroupShape.reform_refused)."""
    held = held or hold_port(cfg)
    port = held.getsockname()[1] if held else 0
    cmd = [sys.executable, "-m", COORDINATOR, "--replicas", str(cfg.run.replicas),
           "--group-size", str(cfg.parallel.group_size),
           "--run-dir", str(run_dir), "--port", str(port), "--heartbeat-timeout", str(cfg.coord.heartbeat_timeout),
           "--progress-timeout", str(cfg.coord.progress_timeout),
           "--startup-timeout", str(cfg.coord.startup_timeout), "--quotas", cfg.run.quotas,
           "--plan", plan_arg(group_shape(cfg)), *(["--reform-refused", refused] if refused else []),
           "--detector", json.dumps(asdict(cfg.detector)),
           "--poll", str(cfg.coord.heartbeat_interval),  # reading beats faster than they come is waste
           "--metrics-port", str(cfg.metrics.port), "--metrics-host", cfg.metrics.host,
           "--tensorboard", cfg.metrics.tensorboard, "--wandb", cfg.metrics.wandb,
           "--checkpoint-dir", str(cfg.checkpoint.dir or run_dir / "checkpoints") if cfg.checkpoint.every else "",
           "--store", cfg.coord.store,  # etcd: the coordinator binds nothing, the state lives there
           "--lease-ttl", str(cfg.coord.lease_ttl), *(["--listen-fd", str(held.fileno())] if held else [])]
    address = cfg.coord.store or f"127.0.0.1:{port}"
    (run_dir / "coordinator.addr").write_text(f"{address}\n")  # for `unbroken status RUN_DIR`
    name = f"coordinator{n}" if n else "coordinator"  # n > 0: a standby (etcd)
    log = run_dir / "logs" / f"{name}.log"
    try:
        if zygote is not None and zygote.usable():
            p = zygote.spawn(cmd[2], cmd[3:], dict(os.environ), str(log), keep=(held.fileno(),) if held else ())
        else:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
                                 pass_fds=(held.fileno(),) if held else ())
    finally:
        if held:
            held.close()  # the coordinator holds its own copy: the port is free again once it exits
    (run_dir / "logs" / f"{name}.pid").write_text(str(p.pid))  # for operators (and tests) to kill -9
    (run_dir / "logs" / f"{name}.started").write_text(str(start_time(p.pid)))  # that pid's process (resume.py)
    return p, address


def fork_server(cfg: Config, held: socket.socket | None = None) -> Zygote | None:
    """The fork server for this run (zygote.py), started first: it forks the coordinator (on the port
    `held`, which it holds until then), the snapshot agents (agents.py), one-rank groups' trainers, and
    the torchrun agents (forkrun) of groups of several ranks, whose ranks fork from them. None where
    nothing is forked (`--launch.launcher` direct or torchrun)."""
    if cfg.launch.launcher != "fork":
        return None
    modules = [COORDINATOR, DEFAULT_WORKER[2]] + ([FORKRUN] if cfg.parallel.group_size > 1 else []) \
        + ([SNAPSHOT_AGENT] if cfg.snapshot.enabled else [])
    return Zygote.start(modules, {**os.environ, "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"},
                        hold=(held.fileno(),) if held else ())


def _torchrun(cfg: Config, cmd: list[str]) -> str:
    """The torchrun module a group's agent runs: under "fork" with the default worker, forkrun (torchrun's
    own agent, its ranks forked from it once it imported the worker); else torchrun itself."""
    return FORKRUN if cfg.launch.launcher == "fork" and cmd == DEFAULT_WORKER else "torch.distributed.run"


def start_worker(cfg: Config, cmd: list[str], run_dir: Path, address: str, r: int, generation: int,
                  resume: str, run_id: str, recorded: int = -1,
                  zygote: Zygote | None = None) -> subprocess.Popen | Forked:
    env = {**os.environ, "UNBROKEN_STORE": address, "UNBROKEN_REPLICA": str(r), "UNBROKEN_RUN_DIR": str(run_dir),
           "UNBROKEN_GENERATION": str(generation), "UNBROKEN_RESUME": resume, "UNBROKEN_RUN_ID": run_id,
           # a restart restores no step past the last one with a record in the log: a snapshot can be
           # sealed before its step's record is out, and a store lost with its coordinator takes the
           # commit with it (`unbroken resume` would then miss that step's record)
           "UNBROKEN_RESTORE_MAX": str(recorded),
           # the intra-group world of a replica group (one rank in data parallelism), as torchrun sets it
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           # group r's ranks take GPUs r x G + their rank (modulo the GPUs: runtime/parallel/device.py)
           "UNBROKEN_DEVICE_BASE": str(r * cfg.parallel.group_size),
           "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    if cfg.parallel.on_rank_loss == "replan":  # a torchrun agent per rank, as a group spanning hosts
        return start_agents(cfg, cmd, run_dir, address, r, f"{run_id}-g{generation}-r{r}", env, zygote)
    torchrun = cfg.launch.launcher == "torchrun" or cfg.parallel.group_size > 1
    if torchrun:  # the cluster's command: a torchrun
        # job for the group (torchrun sets RANK, LOCAL_RANK and WORLD_SIZE itself, and the group's
        # MASTER_ADDR/PORT); the worker's own module or script after it. Groups of several ranks always.
        cmd = [sys.executable, "-m", _torchrun(cfg, cmd), "--standalone",
               f"--nproc-per-node={cfg.parallel.group_size}", f"--max-restarts={cfg.launch.restarts}", *cmd[1:]]
    mine = None
    if cfg.launch.pin_cores:  # inherited by the group's torchrun agent and its ranks
        cores, G = sorted(os.sched_getaffinity(0)), cfg.parallel.group_size
        mine = sorted({cores[(r * G + j) % len(cores)] for j in range(G)})
    log = run_dir / "logs" / f"replica{r}.log"
    if zygote is not None and zygote.usable():  # the default worker, or forkrun's agent (fork_server)
        p = zygote.spawn(cmd[2], cmd[3:], env, str(log), mine)
    else:
        pin = (lambda: os.sched_setaffinity(0, mine)) if mine else None  # runs in the child before exec
        p = subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, preexec_fn=pin)
    (run_dir / "logs" / f"replica{r}.pid").write_text(str(p.pid))  # for operators (and tests) to kill -9
    return p


def start_agents(cfg: Config, cmd: list[str], run_dir: Path, address: str, r: int, job: str,
                  env: dict[str, str], zygote: Zygote | None = None) -> AgentGroup:
    """Group r as one torchrun agent per rank (`--nnodes=G --nproc-per-node=1`), rendezvousing (c10d) on the
    coordinator's store, which outlives every trainer: where one agent per group (`--standalone`) stops
    every rank when one dies, a rank here dies alone, and its group's survivor can go on shrunk
    (parallel.on_rank_loss=replan). `job`, the rendezvous id, names run, generation and group; no restarts: a lost
    rank is replaced by starting its agent again (which re-forms the group at its full plan). A lost
    agent stays a participant of the rendezvous until its keep-alives lapse (3 x 1 s here; torch's
    default 3 x 5 s): only then can a replacement's agent take its place."""
    G = cfg.parallel.group_size
    line = [sys.executable, "-m", _torchrun(cfg, cmd), f"--nnodes={G}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={address}",
            "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3",
            f"--rdzv-id={job}", f"--max-restarts={cfg.launch.restarts}", *cmd[1:]]

    # torch 2.13's agents share the rendezvous store with their workers, publishing its address once per
    # agent: after a membership change the new round's rank 0 may not publish it again, and the new agent
    # waits forever (seen: a replacement rank hung in RendezvousStoreInfo.build). Unshared, rank 0 of every
    # round publishes a fresh address, and the group's rank 0 serves its workers' store (intra_group).
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def start(j: int) -> subprocess.Popen | Forked:
        log = run_dir / "logs" / (f"replica{r}.log" if j == 0 else f"replica{r}.agent{j}.log")
        if zygote is not None and zygote.usable():  # forkrun's agent, forked (fork_server)
            return zygote.spawn(line[2], line[3:], env, str(log))
        return subprocess.Popen(line, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    group = AgentGroup([start(j) for j in range(G)], start)
    (run_dir / "logs" / f"replica{r}.pid").write_text(str(group.pid))
    return group
