"""A simulated cluster described in TOML: layout, step costs, recovery costs, failure causes and traces.

Owns: the scenario's frozen values, loading them from a file, and rejecting bad input with one line
(ScenarioError names the file and the offending key). Does not own: drawing failures (cluster.py) or what
a strategy does with them (strategies/).

Every parameter that is not a cited figure must be listed in the top-level `chosen` array, so the summary
can print it as chosen; `load` refuses a `chosen` entry that names no key of the file.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SCOPES = ("gpu", "node", "software", "slow")


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class Cluster:
    dp: int  # data-parallel replica groups: the unit of failure and of quota
    tp: int = 1
    pp: int = 1
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Workload:
    microbatches: int  # M, per step, constant in a failure-free run
    tokens_per_microbatch: int
    microbatch_seconds: float  # one replica group's forward+backward of one microbatch, s
    sync_seconds: float  # all-reduce + optimizer step after the last microbatch, s
    duration_hours: float  # wall-clock horizon of the simulated run, h


@dataclass(frozen=True)
class Costs:
    detect_seconds: float  # heartbeat timeout: fail-stop -> declared dead, s
    reform_seconds: float  # survivors re-form their groups for a new epoch, s
    restart_seconds: float  # relaunch every process of the job (scheduler, imports, NCCL init), s
    reload_seconds: float  # load a persistent checkpoint from shared storage, s
    checkpoint_seconds: float  # training blocked per persistent checkpoint, s
    snapshot_seconds: float  # training blocked per in-memory snapshot (taken every step), s
    memory_restore_seconds: float  # restore the last in-memory snapshot after a restart, s
    rejoin_seconds: float  # a replacement replica pulls state from a live peer, s (survivors go on)
    replace_seconds: float  # failed hardware -> replacement usable; inf = never replaced, s


@dataclass(frozen=True)
class Model:
    """What re-planning (policy/stepcost.py) needs of the model and the links; an optional [model] table.
    The defaults describe a 70B-parameter model on H100 hosts: chosen, not cited."""
    layers: int = 80  # transformer blocks
    state_gb_per_layer: float = 13.76  # parameters + gradients + optimizer state of one block, GB (0.86e9
    # parameters x 16 B: bf16 weights and gradients, fp32 master weights and Adam moments)
    activation_bytes_per_token: float = 16384.0  # one block boundary's activation per token (8192 x bf16)
    state_budget_gb: float = 60.0  # per GPU for that state (80 GB HBM less room for activations), GB
    tp_gb_per_s: float = 300.0  # per-GPU bus bandwidth of a TP all-reduce inside a host (NVLink 4), GB/s
    pp_gb_per_s: float = 25.0  # stage-to-stage and peer-to-peer across hosts (a 200 Gb/s NIC per GPU), GB/s


@dataclass(frozen=True)
class Cause:
    name: str
    scope: str  # one of SCOPES
    count: float  # events observed ...
    over_gpus: int  # ... on a cluster of this many GPUs ...
    over_hours: float  # ... over this many hours
    factor: float = 1.0  # slow: a device runs `factor` times slower
    duration_seconds: float = 0.0  # slow: how long an episode lasts, s
    units: int = 1  # gpus or nodes taken by one event

    def rate_per_second(self, gpus: int) -> float:
        """Expected events per second on `gpus` GPUs: the source's rate per GPU-hour, scaled by size."""
        return self.count / (self.over_gpus * self.over_hours * 3600.0) * gpus


@dataclass(frozen=True)
class TraceEvent:
    at_hours: float
    cause: str
    scope: str
    units: int = 1  # gpus or nodes lost at once
    factor: float = 1.0
    duration_seconds: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str
    cluster: Cluster
    workload: Workload
    costs: Costs
    causes: tuple[Cause, ...] = ()
    trace: tuple[TraceEvent, ...] = ()
    chosen: tuple[str, ...] = ()
    path: str = ""
    model: Model = Model()

    @property
    def step_tokens(self) -> int:
        return self.workload.microbatches * self.workload.tokens_per_microbatch

    def failure_rate(self, scopes: tuple[str, ...] = ("gpu", "node", "software")) -> float:
        """Expected interrupting events per second of the random causes in `scopes`."""
        return sum(c.rate_per_second(self.cluster.gpus) for c in self.causes if c.scope in scopes)


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ScenarioError with one line on any bad input."""
    p = Path(path)
    try:
        tree = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {str(p)!r} not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        raise ScenarioError(f"scenario file {str(p)!r}: {e}") from None
    return from_tree(tree, str(p))


def from_tree(tree: dict[str, Any], where: str = "<scenario>") -> Scenario:
    """A validated Scenario from a parsed TOML tree."""
    top = {"name", "source", "cluster", "workload", "costs", "cause", "trace", "chosen", "model"}
    for key in tree:
        if key not in top:
            raise ScenarioError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(top))})")
    for section in ("cluster", "workload", "costs"):
        if not isinstance(tree.get(section), dict):
            raise ScenarioError(f"{where}: missing table [{section}]")
    cluster = _build(Cluster, tree["cluster"], f"{where}: cluster")
    workload = _build(Workload, tree["workload"], f"{where}: workload")
    costs = _build(Costs, tree["costs"], f"{where}: costs")
    model = _build(Model, tree.get("model", {}), f"{where}: model")
    causes = tuple(_build(Cause, c, f"{where}: cause[{i}]") for i, c in enumerate(_list(tree, "cause", where)))
    trace = tuple(_build(TraceEvent, e, f"{where}: trace[{i}]") for i, e in enumerate(_list(tree, "trace", where)))
    chosen = tree.get("chosen", [])
    if not isinstance(chosen, list) or not all(isinstance(c, str) for c in chosen):
        raise ScenarioError(f"{where}: chosen must be an array of dotted key names")
    for c in chosen:
        if not _names_key(tree, c):
            raise ScenarioError(f"{where}: chosen entry {c!r} names no key of the scenario")
    sc = Scenario(str(tree.get("name", Path(where).stem)), str(tree.get("source", "")), cluster, workload,
                  costs, causes, trace, tuple(chosen), where, model)
    _check(sc, where)
    return sc


def _list(tree: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    items = tree.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ScenarioError(f"{where}: {key} must be an array of tables ([[{key}]])")
    return items


def _names_key(tree: dict[str, Any], dotted: str) -> bool:
    """`section.key`, or `cause.NAME.key` for a cause's field."""
    parts = dotted.split(".")
    if len(parts) == 2 and isinstance(tree.get(parts[0]), dict):
        return parts[1] in tree[parts[0]]
    if len(parts) == 3 and parts[0] in ("cause", "trace"):
        return any(str(c.get("name", c.get("cause"))) == parts[1] and parts[2] in c for c in tree.get(parts[0], []))
    return False


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ScenarioError(f"{where} must be a table")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, raw in values.items():
        if key not in known:
            raise ScenarioError(f"{where}: unknown key {key!r} (known: {', '.join(known)})")
        tp = known[key].type
        if tp == "int" and not (isinstance(raw, int) and not isinstance(raw, bool)):
            raise ScenarioError(f"{where}.{key}={raw!r} must be an integer")
        if tp == "float" and not (isinstance(raw, int | float) and not isinstance(raw, bool)):
            raise ScenarioError(f"{where}.{key}={raw!r} must be a number")
        if tp == "str" and not isinstance(raw, str):
            raise ScenarioError(f"{where}.{key}={raw!r} must be a string")
        kwargs[key] = float(raw) if tp == "float" else raw
    try:
        return cls(**kwargs)
    except TypeError as e:
        missing = [n for n, f in known.items() if n not in kwargs and f.default is f.default_factory]
        raise ScenarioError(f"{where}: missing key(s) {', '.join(missing)}") from e


def _check(sc: Scenario, where: str) -> None:
    c, w, k = sc.cluster, sc.workload, sc.costs
    rules = [
        (min(c.dp, c.tp, c.pp, c.gpus_per_node) >= 1, "cluster sizes must be >= 1"),
        (w.microbatches >= c.dp, f"workload.microbatches={w.microbatches} must be >= cluster.dp={c.dp}"),
        (w.tokens_per_microbatch >= 1, "workload.tokens_per_microbatch must be >= 1"),
        (w.microbatch_seconds > 0 and w.sync_seconds >= 0, "workload step costs must be > 0"),
        (0 < w.duration_hours < math.inf, "workload.duration_hours must be finite and > 0"),
        (all(getattr(k, f.name) >= 0 for f in fields(Costs)), "costs must be >= 0"),
        (sc.model.layers >= c.pp, f"model.layers={sc.model.layers} must be >= cluster.pp={c.pp}"),
        (all(getattr(sc.model, f.name) > 0 for f in fields(Model) if f.name != "activation_bytes_per_token")
         and sc.model.activation_bytes_per_token >= 0, "model sizes and speeds must be > 0"),
    ]
    for cause in sc.causes:
        rules.append((cause.scope in SCOPES, f"cause {cause.name!r}: scope must be one of {', '.join(SCOPES)}"))
        rules.append((cause.count >= 0 and cause.over_gpus > 0 and cause.over_hours > 0,
                      f"cause {cause.name!r}: count >= 0, over_gpus > 0, over_hours > 0"))
        rules.append((cause.scope != "slow" or (cause.factor > 1 and cause.duration_seconds > 0),
                      f"cause {cause.name!r}: a slow cause needs factor > 1 and duration_seconds > 0"))
    for e in sc.trace:
        rules.append((e.scope in SCOPES, f"trace event {e.cause!r}: scope must be one of {', '.join(SCOPES)}"))
        rules.append((0 <= e.at_hours < w.duration_hours, f"trace event {e.cause!r}: at_hours outside the run"))
        rules.append((e.units >= 1, f"trace event {e.cause!r}: units must be >= 1"))
    for ok, msg in rules:
        if not ok:
            raise ScenarioError(f"{where}: {msg}")
