"""The config tree: the root `Config`, read from a TOML file and `--a.b=value` overrides, and checked.

Owns: the precedence (defaults < file < overrides), the old names of keys that moved (MOVED, read as the
new ones in files, flags and an earlier run's config.json), the coercion of CLI strings, the check every
`Literal[...]` key gets from its type (one line naming the key, the bad value and the allowed values),
the checks across keys (restart-memory needs snapshots, the degrees inside a group), the directories a
run writes (`check_paths`), and the JSON form handed to workers. Does not own: the sections' keys, types,
defaults and docs (schema.py).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken import storeurl
from unbroken.config.domains import domain_problem
from unbroken.config.schema import (CheckpointConfig, ConfigError, CoordConfig, DataConfig, DetectorSection,
                                    DetectSection, EvalConfig, FaultsConfig, HardwareSection, LaunchConfig,
                                    MetricsConfig, ModelConfig,
                                    OptimConfig, ParallelConfig, RunConfig, SnapshotConfig, literal_problem)
from unbroken.topology import Topology


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    coord: CoordConfig = field(default_factory=CoordConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    detector: DetectorSection = field(default_factory=DetectorSection)
    detect: DetectSection = field(default_factory=DetectSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def topology(self) -> Topology:
        """Replica groups x ranks per group, over the snapshot nodes."""
        p = self.parallel
        return Topology.of_nodes(self.run.replicas, p.group_size, self.snapshot.nodes, p.pp, p.tp)

    @staticmethod
    def from_json(text: str) -> "Config":
        return build(json.loads(text))


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]

# keys that moved, old dotted name -> new: the one place an old name is read as its new one, wherever a
# key is named (flags, TOML files, the config.json of a run written before, the Python API's keywords)
MOVED = {
    "parallel.reform_seconds": "hardware.reform_seconds",
    "run.faults": "faults.spec",
    "run.out": "launch.out",
    "run.progress": "launch.progress",
    "run.launcher": "launch.launcher",
    "run.restarts": "launch.restarts",
    "run.max_job_restarts": "launch.max_job_restarts",
    "run.pin_cores": "launch.pin_cores",
}


def canonical(dotted: str) -> str:
    """A dotted key under its current name (an old name in MOVED gives its new one)."""
    return MOVED.get(dotted, dotted)


def upgrade(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of a nested config dict (a TOML file's, a config.json's) with each old key moved to its new
    name; unchecked otherwise. Raises ConfigError where a key is set under both names."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for old, new in MOVED.items():
        section, _, key = old.partition(".")
        if isinstance(tree.get(section), dict) and key in tree[section]:
            to, _, name = new.partition(".")
            target = tree.setdefault(to, {})
            if not isinstance(target, dict):
                raise ConfigError(f"config section {to!r} must be a table")
            if name in target:
                raise ConfigError(f"{old} and {new} are both set: {old} is the old name of {new}; keep one")
            target[name] = tree[section].pop(key)
    return tree


def build(tree: dict[str, Any], overrides: dict[str, Any] | None = None) -> Config:
    """A validated Config from a nested dict plus dotted overrides (values may be strings from the CLI).
    Old key names (MOVED) are read as their new ones in both."""
    tree = upgrade(tree)
    for dotted, value in (overrides or {}).items():
        dotted = canonical(dotted)
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r} must look like section.key")
        tree.setdefault(section, {})[key] = value
    built = {}
    for name, sub in tree.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r} (known: {', '.join(SECTIONS)})")
        if not isinstance(sub, dict):
            raise ConfigError(f"config section {name!r} must be a table")
        built[name] = _section(SECTIONS[name], name, sub)
    cfg = Config(**built)
    validate(cfg)
    return cfg


def _section(cls: type, name: str, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, raw in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key {name}.{key}")
        kwargs[key] = coerce(hints[key], raw, f"{name}.{key}")
    return cls(**kwargs)


def coerce(tp: Any, raw: Any, where: str) -> Any:
    """`raw` (a TOML value or a CLI string) as type `tp`; ConfigError naming `where` if it is none."""
    if isinstance(tp, types.UnionType):
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        problem = literal_problem(tp, raw, where)
        if problem:
            raise ConfigError(problem)
        return raw
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


def load(path: str | None, overrides: dict[str, Any] | None = None) -> Config:
    """Config from an optional TOML file plus overrides. Raises ConfigError (one line) on bad input."""
    tree: dict[str, Any] = {}
    if path:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path!r} is a directory") from None
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


def validate(cfg: Config) -> None:
    """Raise ConfigError with one line for the first impossible value: first any `Literal[...]` key
    outside its values (checked from its type, here for every such key), then the checks below."""
    for name, section in vars(cfg).items():
        for key, tp in typing.get_type_hints(type(section)).items():
            problem = literal_problem(tp, getattr(section, key), f"{name}.{key}")
            if tp in (int, float):  # by the key's meaning, before any check below divides by it
                problem = problem or domain_problem(f"{name}.{key}", getattr(section, key))
            if problem:
                raise ConfigError(problem)
    r, m, launch = cfg.run, cfg.model, cfg.launch
    checks = [
        (r.replicas >= 1, f"run.replicas={r.replicas}: need at least 1 replica"),
        (r.steps >= 1, f"run.steps={r.steps}: need at least 1 step"),
        (r.microbatches >= 1, f"run.microbatches={r.microbatches}: need at least 1 microbatch"),
        (r.threads >= 1, f"run.threads={r.threads}: need at least 1 thread"),
        (launch.restarts >= 0, f"launch.restarts={launch.restarts}: must be >= 0"),
        (launch.max_job_restarts >= 0, f"launch.max_job_restarts={launch.max_job_restarts}: must be >= 0"),
        (launch.restarts == 0 or launch.launcher == "torchrun" or cfg.parallel.group_size > 1,
         f"launch.restarts={launch.restarts} needs --launch.launcher=torchrun (torchrun restarts a group)"),
        (m.n_embd % m.n_head == 0, f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}"),
        (m.block_size >= 2, f"model.block_size={m.block_size}: too short"),
        (m.n_kv_head >= 0, f"model.n_kv_head={m.n_kv_head}: must be >= 0 (0: model.n_head)"),
        (m.arch != "llama" or (m.n_embd // max(1, m.n_head)) % 2 == 0,
         f"model.n_embd={m.n_embd} / model.n_head={m.n_head}: rotary embeddings need an even head width"),
        (m.intermediate_size >= 0 and m.ffn_dim_multiplier >= 0 and m.rope_theta > 0,
         "model.intermediate_size and model.ffn_dim_multiplier must be >= 0, model.rope_theta > 0"),
        (0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout}: must be in [0, 1)"),
        (cfg.data.batch_size >= 1, f"data.batch_size={cfg.data.batch_size}: need at least 1"),
        (cfg.data.ignore_index < 0, f"data.ignore_index={cfg.data.ignore_index}: must be negative (a token id "
                                    f"would leave the loss)"),
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
        (r.recovery != "restart-memory" or s.enabled, "run.recovery=restart-memory needs --snapshot.enabled=true"),
        (r.recovery != "restart-disk" or cfg.checkpoint.every > 0, "run.recovery=restart-disk needs --checkpoint.every=T"),
        (s.every >= 1, f"snapshot.every={s.every}: need at least 1"),
        (s.nodes >= 1 and r.replicas % s.nodes == 0, f"snapshot.nodes={s.nodes} does not divide run.replicas={r.replicas}"),
        (s.parity == "none" or (s.k >= 1 and s.m >= 1 and s.nodes % group == 0 and (s.parity == "rs" or s.m == 1)),
         f"snapshot.parity={s.parity} with k={s.k}, m={s.m} does not fit snapshot.nodes={s.nodes} (xor: m=1)"),
        (cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0"),
        *_optim_checks(cfg),
        *_eval_checks(cfg),
        (0 <= cfg.metrics.port <= 65535, f"metrics.port={cfg.metrics.port}: must be in 0..65535"),
    ]
    checks += _tuning_checks(cfg)
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_data_path(cfg.data.path)
    if cfg.eval.path:
        _check_data_path(cfg.eval.path, "eval.path")
    _check_seq_len(cfg.data.seq_len, m.block_size)


def _eval_checks(cfg: Config) -> list[tuple[bool, str]]:
    """[eval]: a held-out source, and the layouts evaluation runs in."""
    e = cfg.eval
    return [
        # eval.every, eval.microbatches and eval.split's ranges: domains.py
        (not (e.path and e.split), f"eval.split={e.split} with eval.path={e.path!r}: held-out data comes from one"),
        (e.every == 0 or bool(e.path) or e.split > 0,
         f"eval.every={e.every} needs held-out data: eval.path=FILES or eval.split=FRACTION"),
        (e.every == 0 or cfg.parallel.group_size == 1 or cfg.parallel.on_rank_loss == "drop",
         f"eval.every={e.every} with parallel.on_rank_loss={cfg.parallel.on_rank_loss}: a shrunk group does not "
         f"evaluate yet; use on_rank_loss=drop"),
    ]


def _parallel_checks(cfg: Config) -> list[tuple[bool, str]]:
    """The degrees inside a replica group: group_size = pp x tp x FSDP shards, and what each one needs.
    Each message names the offending key=value first."""
    p, m = cfg.parallel, cfg.model
    g, pp, tp = max(1, p.group_size), p.pp, p.tp
    kv = (m.n_kv_head or m.n_head) if m.n_kv_head >= 0 and tp >= 1 else 0
    fsdp = g // (pp * tp) if pp >= 1 and tp >= 1 and g % (pp * tp) == 0 else 0
    return [
        (pp >= 1, f"parallel.pp={pp}: need at least 1 stage"),
        (tp >= 1, f"parallel.tp={tp}: need at least 1"),
        (fsdp >= 1, f"parallel.group_size={p.group_size} is not parallel.pp={pp} x parallel.tp={tp} x a whole "
                    f"number of FSDP shards"),
        (m.n_head % tp == 0,
         f"parallel.tp={tp} does not divide model.n_head={m.n_head} (each rank takes whole heads)"),
        (m.arch != "llama" or kv == 0 or m.n_head % kv == 0,
         f"model.n_kv_head={m.n_kv_head} does not divide model.n_head={m.n_head} (grouped-query attention)"),
        (m.arch != "llama" or kv == 0 or kv % tp == 0,
         f"parallel.tp={tp} does not divide model.n_kv_head={kv} (each rank takes whole key/value heads)"),
        (pp <= m.n_layer, f"parallel.pp={pp}: more stages than model.n_layer={m.n_layer} blocks"),
        (p.mixed_precision == "off" or pp == 1 or p.on_rank_loss == "drop",
         f"parallel.mixed_precision={p.mixed_precision} with parallel.pp={pp} and parallel.on_rank_loss="
         f"{p.on_rank_loss}: a re-formed pipeline passes float32 activations; bf16 stages run with on_rank_loss=drop"),
        (p.cross_backend != "nccl" or p.device != "cpu",
         "parallel.cross_backend=nccl with parallel.device=cpu: NCCL reduces CUDA tensors only; use "
         "--parallel.cross_backend=auto or gloo"),
        (p.claim_wait >= 0, f"parallel.claim_wait={p.claim_wait}: must be >= 0 (seconds)"),
        (p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb}: must be > 0 (MB)"),
        (p.replace_after < 0 or p.on_rank_loss == "replan",
         f"parallel.replace_after={p.replace_after} needs parallel.on_rank_loss=replan (a rank's own agent)"),
        (p.on_rank_loss == "drop" or g >= 2,
         f"parallel.on_rank_loss=replan with parallel.group_size={g}: a group of one rank has no other rank to "
         f"go on without it"),
        (p.on_rank_loss == "drop" or not cfg.coord.store,
         "parallel.on_rank_loss=replan with coord.store set: the groups' torchrun rendezvous is hosted on the "
         "coordinator's TCPStore, which an etcd store replaces"),
    ]


def builtin_data_problem(cfg: Config) -> str | None:
    """Why the built-in data source (data.* keys) cannot feed the run's group layout (None: it can): FSDP2's
    shards must divide data.batch_size, and pipeline stages need one fixed data.seq_len. A user's data
    object is checked on its own microbatches instead (model/data/contract.py). Call before start."""
    p = cfg.parallel
    fsdp = cfg.topology().dp_shard
    if cfg.data.batch_size % fsdp:
        return (f"parallel.group_size={p.group_size} does not divide data.batch_size={cfg.data.batch_size} into "
                f"its {fsdp} FSDP shards (group_size / (pp x tp): each takes an equal share of every microbatch's "
                f"sequences)")
    if p.pp > 1 and not cfg.data.seq_len.strip().isdigit():
        return (f"parallel.pp={p.pp} with data.seq_len={cfg.data.seq_len!r}: pipeline stages pass activations of "
                f"one fixed shape, so the sequence length must be one number")
    return None


def _tuning_checks(cfg: Config) -> list[tuple[bool, str]]:
    """[detector] and [hardware]: thresholds and figures the policy code divides by or counts with."""
    d, h = cfg.detector, cfg.hardware
    positive = [("detector", k) for k in ("suspect_at", "slow_at", "max_increment", "min_speed", "design_noise",
                                          "drift_sigmas", "suspect_sigmas", "slow_sigmas", "recover_sigmas")] + \
        [("hardware", k) for k in ("tp_bytes_per_s", "pp_bytes_per_s", "peer_bytes_per_s", "state_budget_bytes")]
    checks = [(getattr(getattr(cfg, s), k) > 0, f"{s}.{k}={getattr(getattr(cfg, s), k)}: must be > 0")
              for s, k in positive]
    ratios = ("drift_ratio", "recover_below_ratio", "regime_move_ratio", "warmup_drift_ratio")
    checks += [(getattr(d, k) >= 1.0, f"detector.{k}={getattr(d, k)}: a slowdown ratio, must be >= 1")
               for k in ratios]
    counts = ("recover_steps", "min_fleet", "speed_window", "refit_every", "replay_steps", "locate_steps")
    checks += [(getattr(d, k) >= 1, f"detector.{k}={getattr(d, k)}: must be >= 1") for k in counts]
    return checks + [
        (d.suspect_at <= d.slow_at, f"detector.suspect_at={d.suspect_at} exceeds detector.slow_at={d.slow_at}"),
        (0 < d.regime_quorum < 1, f"detector.regime_quorum={d.regime_quorum}: must be in (0, 1)"),
        (d.min_speed <= 1, f"detector.min_speed={d.min_speed}: must be <= 1"),
        (d.warmup_steps >= 0 and d.join_skip >= 0,
         f"detector.warmup_steps={d.warmup_steps}, detector.join_skip={d.join_skip}: must be >= 0"),
        (d.noise_window >= 16, f"detector.noise_window={d.noise_window}: must be >= 16"),
        (d.noise_cap >= 1, f"detector.noise_cap={d.noise_cap}: must be >= 1"),
        (3 <= d.min_samples <= d.predictor_window,
         f"detector.min_samples={d.min_samples}: must be in 3..detector.predictor_window={d.predictor_window}"),
        (h.reform_seconds >= 0, f"hardware.reform_seconds={h.reform_seconds}: must be >= 0"),
    ]


def store_url_problem(url: str) -> str | None:
    """Why `url` is not a store address (None: fine, or empty: the coordinator's own store). Syntax only:
    whether it answers is checked by store.preflight when a run starts."""
    return storeurl.problem(url)


def check_paths(cfg: Config) -> None:
    """Raise ConfigError naming the first directory the run would write but cannot: launch.out, and
    snapshot.shm_dir / checkpoint.dir where they are used. Call before anything starts (it reads the
    file system, so `validate`, which workers call on a config already checked, does not)."""
    wanted = [("launch.out", cfg.launch.out)]
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


def _check_data_path(spec: str, key: str = "data.path") -> None:
    """data.path names a file, or a glob matching at least one (what the files hold is checked where
    the run's groups start: model/data/check.py, from api.check_host)."""
    if not spec:
        return
    if any(c in spec for c in "*?["):
        if not any(Path(f).is_file() for f in glob.iglob(spec, recursive=True)):
            raise ConfigError(f"{key}={spec!r}: the glob matches no file")
    elif not Path(spec).is_file():
        raise ConfigError(f"{key}={spec!r}: no such file")


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


def _optim_checks(cfg) -> list[tuple[bool, str]]:
    """The schedule's and clipping's numbers: each one line naming the key."""
    o = cfg.optim
    return [
        (o.lr > 0, f"optim.lr={o.lr}: must be > 0"),
        (o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0"),
        (o.decay_steps >= 0, f"optim.decay_steps={o.decay_steps}: must be >= 0"),
        (o.schedule != "wsd" or o.decay_steps > 0, "optim.schedule=wsd needs --optim.decay_steps=N (N > 0)"),
        (0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]"),
        (o.max_grad_norm >= 0, f"optim.max_grad_norm={o.max_grad_norm}: must be >= 0 (0: no clipping)"),
        (o.lr * o.weight_decay < 1, f"optim.weight_decay={o.weight_decay} with optim.lr={o.lr}: each step scales "
                                    f"the weights by 1 - lr x weight_decay, which must stay positive"),
    ]
