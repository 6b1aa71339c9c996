"""Where a trainer process runs and what it trains: read once at start-up.

Owns: `Placement` (its coordinator, run directory, config, restart generation, restore source and
device), read from the local launcher's environment or, on a cluster, from the coordinator's store
(`placement`); the user's `Factories` and the default ones (the built-in model that model.arch names, the corpus). Does not own:
what the process does with them (lifecycle.py).

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
the run in etcd: the trainer then follows whichever of them leads, as it talks only to the store): the
config, run directory and run id come from the coordinator's store; torchrun's RANK and WORLD_SIZE give
the rank inside the group.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import DistStoreError

from unbroken.config import Config, ConfigError, store_url_problem
from unbroken.runtime.store import keys
from unbroken.runtime.store.client import answering, connect, read


@dataclass(frozen=True)
class Factories:
    """What a user brings. Each is called once per trainer process, after the seed is set.

    model(cfg) -> nn.Module whose forward(x, y) returns the mean loss over counted targets;
    data(cfg) -> object with microbatch(step, i) -> (x, y, tokens, sumsq) and step_tokens(step, M);
    optimizer(params, cfg) -> torch.optim.Optimizer (the default: AdamW over model/optim.param_groups);
    lr_schedule(step) -> lr, the learning rate of committed step `step` for every parameter group (None:
    the configured [optim] schedule, as a factor on each group's own lr);
    plan: the model's parallel plan (model/plan.py; None: the one the model supplies, `plan_of`);
    parallelize(model, mesh, dims) -> model: a user's torchtitan-style function applying FSDP2 and TP in
    place of the plan's (runtime/parallel/parallelize.py: `parallelize`'s `custom`).
    """
    model: Callable[[Config], object]
    data: Callable[[Config], object]
    optimizer: Callable[[list, Config], object]
    lr_schedule: Callable[[int], float] | None = None
    plan: object | None = None
    parallelize: Callable | None = None

    def build_model(self, cfg: Config):
        """The whole model as `model(cfg)` builds it, its weights replaced by model.init_from's Hugging Face
        directory where the run names one (model/hfweights.py): every rank loads the same tensors before
        its plan shards them. Call after seeding, where `model(cfg)` was called."""
        model = self.model(cfg)
        if cfg.model.init_from:
            from unbroken.model.hfweights import load_into
            load_into(model, cfg.model.init_from, cfg.model)
        return model

    def plan_of(self, model) -> object:
        """The parallel plan of `model` (the whole model this process built): the user's, else the model's."""
        from unbroken.model.plan import plan_of
        return self.plan if self.plan is not None else plan_of(model)


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
    from unbroken.model.builtin import built_in
    from unbroken.model.data import DataSource
    from unbroken.model.optim import default_optimizer

    return Factories(model=lambda cfg: built_in(cfg.model, cfg.data.ignore_index),
                     data=lambda cfg: DataSource(cfg.data, cfg.model.block_size, cfg.run.seed,
                                                  microbatches=cfg.run.microbatches, held_out=cfg.eval.split),
                     optimizer=default_optimizer)
