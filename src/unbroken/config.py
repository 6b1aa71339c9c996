"""One config tree: nested frozen dataclasses, loaded from a TOML file, then `--a.b=value` overrides.

Owns: every tunable of a run, its default, its validation (one-line ConfigError naming the bad key), and
the JSON form handed to worker processes. Does not own: what the values do.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken import storeurl
from unbroken.topology import Topology


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 2  # transformer blocks
    n_head: int = 4
    n_embd: int = 64  # width; parameters grow with n_layer * 12 * n_embd**2
    block_size: int = 64  # longest sequence the model takes, tokens
    vocab_size: int = 256  # byte-level
    dropout: float = 0.1  # seeded per microbatch (seed, step, i), never per rank


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # text file or uint16 token file (.bin); empty: the Python standard library's source
    batch_size: int = 4  # sequences per microbatch
    seq_len: str = "64"  # tokens per sequence; "variable" or "MIN-MAX": lengths from document lengths
    max_files: int = 400  # default corpus: how many stdlib files to read


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95


@dataclass(frozen=True)
class CoordConfig:
    heartbeat_interval: float = 0.25  # s between a member's heartbeats and the coordinator's liveness rounds
    heartbeat_timeout: float = 3.0  # s without a heartbeat before a member is declared dead
    startup_timeout: float = 120.0  # s a member may take from its first heartbeat to its first step
    progress_timeout: float = 20.0  # s in one compute microbatch before a beating member is declared stuck
    collective_timeout: float = 30.0  # s before gloo gives up on a collective by itself
    run_timeout: float = 900.0  # s before the launcher gives up on the whole run
    # where coordination state lives: "" the coordinator's own TCPStore (one host); or an etcd cluster,
    # etcd://h1:2379,h2:2379,h3:2379[/namespace] (needs unbroken[etcd]; README: Coordination in etcd)
    store: str = ""
    standbys: int = 1  # with an etcd store: coordinators beside the leader, each ready to take over
    lease_ttl: int = 5  # s (whole): with etcd, a leader silent this long is replaced by a standby


@dataclass(frozen=True)
class RunConfig:
    replicas: int = 4  # data-parallel replica groups (one process each)
    steps: int = 20
    microbatches: int = 8  # per step, constant whatever fails
    seed: int = 0
    exact: bool = False  # float64 accumulation and reduction: bitwise the failure-free trajectory
    threads: int = 1  # torch threads per replica, identical on all (exact mode needs that)
    faults: str = ""  # see faultspec.py
    # "speed": the detector's speed estimates weight the quotas; "equal": never; "drop": a group declared
    # Slow is parked for the rest of the run (no microbatches; ResiHP's drop baseline: replanning.py)
    quotas: str = "speed"
    recovery: str = "live"  # "live" | "restart-memory" | "restart-disk" (see policy/snapshotting.py)
    # commit pipelining: the optimizer steps and the next step computes before the commit decision
    # is read; undone on retry (runtime/trainer/speculation.py). "auto": states up to 8 MiB in host memory
    # (64 MiB on an accelerator), and not with snapshots or checkpoints (trainer.py); "on": any size
    step_ahead: str = "auto"  # "auto" | "on" | "off"
    out: str = "runs/latest"
    progress: bool = True  # live progress with rich
    # how the local launcher starts its processes: "torchrun" runs the cluster's own command (one
    # torchrun job per group, README "On a cluster"); "direct" spawns the worker itself, which saves
    # torchrun's agent process per group (its start-up and one more process per group on the host);
    # "fork" forks the coordinator, the snapshot agents and one-rank groups' trainers from a process that
    # imported torch once (launcher/zygote.py), and a group of several ranks is a forked torchrun agent
    # whose ranks fork from it (runtime/trainer/forkrun.py): ~3 CPU-s less per trainer start and restart
    launcher: str = "fork"
    # torchrun's --max-restarts for each group: a group restarted after a failure rejoins the running job,
    # healed from a live group (the local launcher's torchrun; on a cluster, the user's torchrun line)
    restarts: int = 0
    # the local launcher pins replica group r's processes to its own cores (group r's G ranks share cores
    # r*G .. r*G+G-1, modulo the cores this process may use), as a GPU a rank gives each its own device:
    # a survivor then cannot speed up on a dead peer's core, and a waiting peer lends none to a slow one
    pin_cores: bool = False


@dataclass(frozen=True)
class SnapshotConfig:
    enabled: bool = False  # in-memory snapshots held by one agent process per node
    every: int = 1  # committed steps between snapshots
    nodes: int = 1  # emulated nodes (failure domains), one snapshot agent each; divides run.replicas
    parity: str = "none"  # "none", "xor" (k+1) or "rs" (k+m Reed-Solomon, pyeclib) across nodes
    k: int = 0  # data shards per parity stripe; nodes must be a multiple of k+m
    m: int = 0  # parity shards per stripe
    shm_dir: str = "/dev/shm/unbroken"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # committed steps between DCP checkpoints; 0: none
    dir: str = ""  # default: RUN_DIR/checkpoints


@dataclass(frozen=True)
class ParallelConfig:
    # ranks per replica group: one torchrun job of this many processes per group, the model sharded
    # over them with FSDP2 (HSDP: the replicate dimension across groups is the fault-tolerant one)
    group_size: int = 1
    # pipeline stages inside a group (the GPT's blocks split over them); group_size = pp x tp x FSDP shards
    pp: int = 1
    # tensor-parallel degree inside a group (attention heads and MLP units split; group_size = tp, so far)
    tp: int = 1
    # what a group that loses a rank does: drop (the whole group leaves until torchrun brings it back) or
    # replan (the scheduler of policy/replan_scheduler.py chooses; "shrink" runs the group on its survivor,
    # healed from a peer group). replan starts one torchrun agent per rank, as a group spanning hosts.
    on_rank_loss: str = "drop"
    # the re-plan cost model's one-off cost of re-forming a group after a plan change, s (stated, not
    # measured: stepcost.Hardware's H100 figure; a shrink here re-forms in ~0.1-0.5 s on CPU gloo)
    reform_seconds: float = 2.0
    # local launcher, on_rank_loss=replan: seconds after a rank's torchrun agent ended before a replacement
    # agent starts for it (a spare host arriving: the group re-forms at its full plan); < 0: never
    replace_after: float = -1.0
    # where each rank computes: "auto" (CUDA where its process sees a GPU, else CPU), "cpu" or "cuda". On a
    # GPU a group's ranks talk over NCCL (gloo for the step protocol's CPU tensors); the cross-group
    # fault-tolerant all-reduce stays on gloo (runtime/parallel/device.py says why). Run on one GPU; NCCL
    # inside a group (2 GPUs or more) not yet.
    device: str = "auto"


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 0  # coordinator serves Prometheus /metrics on this port; 0: off (needs unbroken[metrics])
    host: str = "127.0.0.1"  # address /metrics listens on; 0.0.0.0 to let a Prometheus elsewhere scrape it
    tensorboard: str = ""  # directory for TensorBoard event files, written by the coordinator; empty: off


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    coord: CoordConfig = field(default_factory=CoordConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def topology(self) -> Topology:
        """Replica groups x ranks per group, over the snapshot nodes."""
        p = self.parallel
        return Topology.of_nodes(self.run.replicas, p.group_size, self.snapshot.nodes, p.pp, p.tp)

    @staticmethod
    def from_json(text: str) -> "Config":
        return build(json.loads(text))


def build(tree: dict[str, Any], overrides: dict[str, Any] | None = None) -> Config:
    """A validated Config from a nested dict plus dotted overrides (values may be strings from the CLI)."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r} must look like section.key")
        tree.setdefault(section, {})[key] = value
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    built = {}
    for name, sub in tree.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r} (known: {', '.join(sections)})")
        if not isinstance(sub, dict):
            raise ConfigError(f"config section {name!r} must be a table")
        built[name] = _section(_SECTIONS[name], name, sub)
    cfg = Config(**built)
    validate(cfg)
    return cfg


_SECTIONS = {"run": RunConfig, "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "coord": CoordConfig,
             "snapshot": SnapshotConfig, "checkpoint": CheckpointConfig,
             "metrics": MetricsConfig, "parallel": ParallelConfig}


def _section(cls: type, name: str, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, raw in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key {name}.{key}")
        kwargs[key] = _coerce(hints[key], raw, f"{name}.{key}")
    return cls(**kwargs)


def _coerce(tp: Any, raw: Any, where: str) -> Any:
    if isinstance(tp, types.UnionType):
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return tp(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={raw!r} is not a valid {tp.__name__}") from None


def validate(cfg: Config) -> None:
    """Raise ConfigError with one line for the first impossible value."""
    r, m = cfg.run, cfg.model
    checks = [
        (r.replicas >= 1, f"run.replicas={r.replicas}: need at least 1 replica"),
        (r.steps >= 1, f"run.steps={r.steps}: need at least 1 step"),
        (r.microbatches >= 1, f"run.microbatches={r.microbatches}: need at least 1 microbatch"),
        (r.threads >= 1, f"run.threads={r.threads}: need at least 1 thread"),
        (r.quotas in ("speed", "equal", "drop"), f"run.quotas={r.quotas!r}: expected 'speed', 'equal' or 'drop'"),
        (r.step_ahead in ("auto", "on", "off"), f"run.step_ahead={r.step_ahead!r}: expected 'auto', 'on' or 'off'"),
        (r.launcher in ("fork", "direct", "torchrun"),
         f"run.launcher={r.launcher!r}: expected 'fork', 'direct' or 'torchrun'"),
        (r.restarts >= 0, f"run.restarts={r.restarts}: must be >= 0"),
        (r.restarts == 0 or r.launcher == "torchrun" or cfg.parallel.group_size > 1,
         f"run.restarts={r.restarts} needs --run.launcher=torchrun (torchrun restarts a group)"),
        (m.n_embd % m.n_head == 0, f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}"),
        (m.block_size >= 2, f"model.block_size={m.block_size}: too short"),
        (0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout}: must be in [0, 1)"),
        (cfg.data.batch_size >= 1, f"data.batch_size={cfg.data.batch_size}: need at least 1"),
        (cfg.parallel.group_size >= 1, f"parallel.group_size={cfg.parallel.group_size}: need at least 1 rank"),
        *_parallel_checks(cfg),
        (cfg.coord.heartbeat_interval > 0, "coord.heartbeat_interval must be > 0"),
        *((getattr(cfg.coord, t) > 0, f"coord.{t}={getattr(cfg.coord, t)}: must be > 0 (seconds)")
          for t in ("startup_timeout", "progress_timeout", "collective_timeout", "run_timeout")),
        (cfg.coord.heartbeat_timeout > 2 * cfg.coord.heartbeat_interval,
         "coord.heartbeat_timeout must exceed two heartbeat intervals"),
        (cfg.coord.standbys >= 0, f"coord.standbys={cfg.coord.standbys}: must be >= 0"),
        (cfg.coord.lease_ttl >= 1, f"coord.lease_ttl={cfg.coord.lease_ttl}: must be >= 1 (whole seconds)"),
        (store_url_problem(cfg.coord.store) is None, f"coord.store={cfg.coord.store!r}: "
                                                       f"{store_url_problem(cfg.coord.store)}"),
    ]
    s = cfg.snapshot
    group = s.k + s.m
    checks += [
        (r.recovery in ("live", "restart-memory", "restart-disk"),
         f"run.recovery={r.recovery!r}: expected live, restart-memory or restart-disk"),
        (r.recovery != "restart-memory" or s.enabled, "run.recovery=restart-memory needs --snapshot.enabled=true"),
        (r.recovery != "restart-disk" or cfg.checkpoint.every > 0, "run.recovery=restart-disk needs --checkpoint.every=T"),
        (s.every >= 1, f"snapshot.every={s.every}: need at least 1"),
        (s.nodes >= 1 and r.replicas % s.nodes == 0, f"snapshot.nodes={s.nodes} does not divide run.replicas={r.replicas}"),
        (s.parity in ("none", "xor", "rs"), f"snapshot.parity={s.parity!r}: expected none, xor or rs"),
        (s.parity == "none" or (s.k >= 1 and s.m >= 1 and s.nodes % group == 0 and (s.parity == "rs" or s.m == 1)),
         f"snapshot.parity={s.parity} with k={s.k}, m={s.m} does not fit snapshot.nodes={s.nodes} (xor: m=1)"),
        (cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0"),
        (0 <= cfg.metrics.port <= 65535, f"metrics.port={cfg.metrics.port}: must be in 0..65535"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if cfg.data.path and not Path(cfg.data.path).is_file():
        raise ConfigError(f"data.path={cfg.data.path!r}: no such file")
    _check_seq_len(cfg.data.seq_len, m.block_size)


def _parallel_checks(cfg: Config) -> list[tuple[bool, str]]:
    """The degrees inside a replica group: group_size = pp x tp x FSDP shards, and what each one needs.
    Each message names the offending key=value first."""
    p, m = cfg.parallel, cfg.model
    g, pp, tp = max(1, p.group_size), p.pp, p.tp
    fsdp = g // (pp * tp) if pp >= 1 and tp >= 1 and g % (pp * tp) == 0 else 0
    fixed = cfg.data.seq_len.strip().isdigit()
    return [
        (pp >= 1, f"parallel.pp={pp}: need at least 1 stage"),
        (tp >= 1, f"parallel.tp={tp}: need at least 1"),
        (fsdp >= 1, f"parallel.group_size={p.group_size} is not parallel.pp={pp} x parallel.tp={tp} x a whole "
                    f"number of FSDP shards"),
        (m.n_head % tp == 0,
         f"parallel.tp={tp} does not divide model.n_head={m.n_head} (each rank takes whole heads)"),
        (pp <= m.n_layer, f"parallel.pp={pp}: more stages than model.n_layer={m.n_layer} blocks"),
        (pp == 1 or fixed, f"parallel.pp={pp} with data.seq_len={cfg.data.seq_len!r}: pipeline stages pass "
                           f"activations of one fixed shape, so the sequence length must be one number"),
        (p.reform_seconds >= 0, f"parallel.reform_seconds={p.reform_seconds}: must be >= 0"),
        (p.replace_after < 0 or p.on_rank_loss == "replan",
         f"parallel.replace_after={p.replace_after} needs parallel.on_rank_loss=replan (a rank's own agent)"),
        (p.device in ("auto", "cpu", "cuda"), f"parallel.device={p.device!r}: expected auto, cpu or cuda"),
        (p.on_rank_loss in ("drop", "replan"), f"parallel.on_rank_loss={p.on_rank_loss!r}: expected drop or replan"),
        (p.on_rank_loss == "drop" or g >= 2,
         f"parallel.on_rank_loss=replan with parallel.group_size={g}: a group of one rank has no other rank to "
         f"go on without it"),
        (p.on_rank_loss == "drop" or not cfg.coord.store,
         "parallel.on_rank_loss=replan with coord.store set: the groups' torchrun rendezvous is hosted on the "
         "coordinator's TCPStore, which an etcd store replaces"),
        (fsdp == 0 or cfg.data.batch_size % fsdp == 0,
         f"parallel.group_size={p.group_size} does not divide data.batch_size={cfg.data.batch_size} "
         f"into its {fsdp} FSDP shards (group_size / (pp x tp): each takes an equal share of every "
         f"microbatch's sequences)"),
    ]


def store_url_problem(url: str) -> str | None:
    """Why `url` is not a store address (None: fine, or empty: the coordinator's own store). Syntax only:
    whether it answers is checked by store.preflight when a run starts."""
    return storeurl.problem(url)


def check_paths(cfg: Config) -> None:
    """Raise ConfigError naming the first directory the run would write but cannot: run.out, and
    snapshot.shm_dir / checkpoint.dir where they are used. Call before anything starts (it reads the
    file system, so `validate`, which workers call on a config already checked, does not)."""
    wanted = [("run.out", cfg.run.out)]
    if cfg.snapshot.enabled:
        wanted.append(("snapshot.shm_dir", cfg.snapshot.shm_dir))
    if cfg.checkpoint.every and cfg.checkpoint.dir:
        wanted.append(("checkpoint.dir", cfg.checkpoint.dir))
    for key, path in wanted:
        problem = _unwritable(Path(path))
        if problem:
            raise ConfigError(f"{key}={path!r}: {problem}")


def _unwritable(path: Path) -> str | None:
    """Why a directory could not be created or written there, or None. Tried, not guessed (os.access says
    yes to root for /proc and for a read-only directory): the missing directories are made, a file is
    created and removed in the deepest, and the directories made are removed again, so a run stopped
    later by another check leaves nothing behind."""
    import os
    import tempfile
    path = path.absolute()
    missing: list[Path] = []
    made: list[Path] = []
    try:
        if path.exists() and not path.is_dir():
            return "exists and is not a directory"
        parent = path
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot be created: {str(parent)!r} is not a directory"
        for d in reversed(missing):
            try:
                d.mkdir()
                made.append(d)
            except FileExistsError:  # made meanwhile by someone else: theirs, not ours to remove
                if not d.is_dir():
                    raise
        fd, probe = tempfile.mkstemp(dir=path, prefix=".unbroken-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "cannot be created" if missing else "directory is not writable"
        return f"{what}: {e.strerror or e}"
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
    return None


def _check_seq_len(spec: str, block_size: int) -> None:
    """data.seq_len is a number, MIN-MAX or "variable" within the model's block (checked here, before
    anything starts; the data source reads it with the same rules in each worker)."""
    s = spec.strip().lower()
    if s == "variable":
        return
    try:
        lo, hi = (int(v) for v in s.split("-", 1)) if "-" in s else (int(s), int(s))
    except ValueError:
        raise ConfigError(f"data.seq_len={spec!r}: expected a number, MIN-MAX or 'variable'") from None
    if not 1 <= lo <= hi <= block_size:
        raise ConfigError(f"data.seq_len={spec!r}: lengths must lie in 1..{block_size} (model.block_size)")


def load(path: str | None, overrides: dict[str, Any] | None = None) -> Config:
    """Config from an optional TOML file plus overrides. Raises ConfigError (one line) on bad input."""
    tree: dict[str, Any] = {}
    if path:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r}: {e}") from None
    return build(tree, overrides)


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--a.b=value` arguments into {"a.b": "value"}; raises ConfigError on anything else."""
    out = {}
    for a in args:
        if not a.startswith("--") or "=" not in a or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unrecognized argument {a!r} (overrides look like --section.key=value)")
        key, value = a[2:].split("=", 1)
        out[key] = value
    return out
