"""The Python API: `unbroken.train(...)` with a user's own model, data and optimizer factories.

Owns: building the config, validating the fault spec before anything starts, and choosing the role of
this process: in a worker (UNBROKEN_REPLICA set) it trains as that replica; otherwise it launches the
coordinator and re-runs the calling script once per replica, as torchrun does. Does not own: training.

    import unbroken
    if __name__ == "__main__":
        result = unbroken.train(model=make_model, data=make_data, optimizer=make_opt, replicas=4, steps=50)
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from unbroken.config import MOVED, Config, ConfigError, RunConfig, build, check_paths
from unbroken.config.tree import builtin_data_problem
from unbroken.faultspec import NETWORK_KINDS, FaultSpecError, parse

# flat keywords: the [run] keys, and the keys that [run] held before they moved (faults=, out=, restarts=, ...)
_FLAT = {f.name for f in dataclasses.fields(RunConfig)} | {old[4:] for old in MOVED if old.startswith("run.")}


def make_config(config: Config | None = None, **run: Any) -> Config:
    """A validated Config: `config` (default: all defaults) with the given keys replaced.

    A flat keyword names a [run] key or one that moved out of [run] (faults=, out=, progress=, launcher=,
    restarts=, max_job_restarts=, pin_cores=: config.MOVED maps them); other keys are given as section__key
    (e.g. model__n_layer=4, launch__out=DIR). Raises ConfigError (one line).
    """
    overrides = {}
    for key, value in run.items():
        if value is None:
            continue
        section, _, name = key.partition("__")
        if not name:
            if key not in _FLAT:
                raise ConfigError(f"unknown run option {key!r}")
            section, name = "run", key
        overrides[f"{section}.{name}"] = value  # an old name: build reads it as its new one
    cfg = build(dataclasses.asdict(config or Config()), overrides)
    try:
        faults = parse(cfg.faults.spec, cfg.run.replicas, cfg.run.steps, group_size=cfg.parallel.group_size)
    except FaultSpecError as e:
        raise ConfigError(f"--faults: {e}") from None
    for f in faults:
        if f.kind in NETWORK_KINDS:
            raise ConfigError(f"--faults: {f.kind} acts on hosts made of namespaces (tests/cluster/); "
                              "a run's own processes cannot inject it")
        if f.kind == "node" and f.node >= cfg.snapshot.nodes:
            raise ConfigError(f"--faults: node={f.node} is out of range (0..{cfg.snapshot.nodes - 1}, snapshot.nodes)")
        if f.kind in ("node", "corrupt", "tear") and not cfg.snapshot.enabled:
            raise ConfigError(f"--faults: {f.kind} needs in-memory snapshots (--snapshot.enabled=true)")
        if f.phase == "parity" and f.kind == "node" and cfg.snapshot.parity == "none":
            raise ConfigError("--faults: phase=parity needs parity across nodes (--snapshot.parity=xor or rs)")
    check_paths(cfg)
    if cfg.parallel.device == "cuda":  # only then: the CPU path does not import torch (~2 s) here
        from unbroken.runtime.parallel.device import resolve

        resolve("cuda")  # ConfigError where this host sees no GPU, as each trainer would say at its start
    return cfg


# why groups whose ranks a user's parallelize function sharded cannot re-form (GroupShape.reform_refused)
CUSTOM_REFUSED = ("a user's parallelize function sharded the model: a survivor cuts each lost rank's slices by "
                  "the model's parallel plan, which the function replaced (pass plan=... to re-form)")


def check_host(cfg: Config, model: Callable | None = None, plan: Any = None,
               parallelize: Callable | None = None, data: Callable | None = None) -> str | None:
    """The checks of a run whose every group this host's launcher starts (`unbroken train`, `resume`, the
    demo, `unbroken.train`), before anything is touched; not the standalone coordinator's, whose groups
    run on other hosts: a group needs a GPU per rank here if its device resolves to CUDA
    (runtime/parallel/device.py: check_gpus), the token files of data.path must be readable, as long as
    one window and inside model.vocab_size (model/data/check.py), and parallel.cross_backend=nccl needs
    CUDA here (runtime/parallel/crossgroup.py: check); a group of several ranks needs a model whose
    parallel plan (`plan`, else the model's) fits parallel.tp and parallel.pp (model/plan.py: `check`,
    on the model built on the meta device: a user's `model` factory, else the built-in one), unless a
    user's `parallelize` function applies them (not with pipeline stages). Returns why a group that
    loses a rank cannot re-form onto fewer ranks under parallel.on_rank_loss=replan (a user's function
    sharded it, or the plan cannot say a lost rank's slices: plan.reform_problem), None where it can or
    the run drops such groups anyway: the coordinator then prices only drop for them (launch.launch's
    `reform_refused`). A user's `data` factory is built once and checked against the data contract on its
    own microbatches (model/data/contract.py); without one, the built-in source's data.* keys against the
    group's layout (config.tree.builtin_data_problem). Raises ConfigError (one line)."""
    from unbroken.model.data.check import check_data
    if data is None:
        check_data(cfg)
        problem = builtin_data_problem(cfg)
        if problem:
            raise ConfigError(problem)
    if cfg.eval.every and cfg.eval.path:  # the held-out files, as the training files are checked
        check_data(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=cfg.eval.path)))
    if cfg.model.init_from:  # only then: hfweights imports torch (~2 s)
        from unbroken.model.hfweights import check_init_from
        check_init_from(cfg, custom_model=model is not None)
    if model is not None or 12 * cfg.model.n_layer * cfg.model.n_embd ** 2 + cfg.model.vocab_size * cfg.model.n_embd > 1e7:
        from unbroken.model.builtin import memory_problem  # torch: only where the model may be large
        problem = memory_problem(cfg, model)
        if problem:
            raise ConfigError(problem)
    if parallelize is not None and cfg.parallel.pp > 1:
        raise ConfigError(f"parallel.pp={cfg.parallel.pp} with a parallelize function: pipeline stages come from "
                          f"the model's parallel plan (pass plan=... instead)")
    if cfg.model.compile:
        _check_compile(cfg, parallelize)
    replan = cfg.parallel.group_size > 1 and cfg.parallel.on_rank_loss == "replan"
    refused = CUSTOM_REFUSED if parallelize is not None and replan else None
    if cfg.parallel.group_size > 1 and parallelize is None and (
            model is not None or plan is not None or cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        from unbroken.model.builtin import check
        refused = check(cfg, model, plan)
    if data is not None:
        from unbroken.model.data.contract import check_data_object
        check_data_object(cfg, data, builtin_model=model is None)
    if cfg.parallel.cross_backend == "nccl":
        from unbroken.runtime.parallel.crossgroup import check
        check(cfg.parallel.cross_backend, cfg.parallel.device)  # CUDA here, or one line before anything starts
    if cfg.parallel.device == "cpu" or (cfg.parallel.device == "auto" and cfg.parallel.group_size == 1):
        return refused  # nothing to check, and the CLI need not import torch (~2 s) for it
    from unbroken.runtime.parallel.device import preflight
    preflight(cfg.parallel.device, cfg.parallel.group_size)
    return refused


def _check_compile(cfg: Config, parallelize: Callable | None) -> None:
    """model.compile: refused in one line where it cannot run here (a parallelize function of the user's
    applies its own layout; the backend lacks its compiler or Triton)."""
    if parallelize is not None:
        raise ConfigError("model.compile=true with a parallelize function: apply torch.compile in it (per block, "
                          "before fully_shard), as torchtitan's parallelize_llama does")
    from unbroken.runtime.parallel.device import resolve
    from unbroken.runtime.parallel.precision import compile_problem

    problem = compile_problem(cfg.model.compile_backend, resolve(cfg.parallel.device).type)
    if problem:
        raise ConfigError(f"model.compile_backend={cfg.model.compile_backend}: {problem}")


def train(config: Config | None = None, *, model: Callable | None = None, data: Callable | None = None,
          optimizer: Callable | None = None, lr_schedule: Callable[[int], float] | None = None,
          plan: Any = None, parallelize: Callable | None = None, **run: Any):
    """Train with fault tolerance; returns a `RunResult` in the launching process.

    model(cfg) -> nn.Module with forward(x, y) -> mean loss; data(cfg) -> object with
    microbatch(step, i) returning (x, y, tokens, sumsq) fields and step_tokens(step, M); optimizer(params,
    cfg) -> torch Optimizer; lr_schedule(step) -> the learning rate of committed step `step` (a pure
    function of it), every parameter group's. Any of them None: the built-in model (model.arch), corpus,
    AdamW over parameter groups, the [optim] schedule. plan: the model's parallel plan
    (unbroken.model.plan.ParallelPlan; None: the model's `parallel_plan()`, or FSDP2 over the root).
    parallelize(model, mesh, dims) -> model: a torchtitan-style function that applies FSDP2 and TP itself
    on a group of several ranks (runtime/parallel/parallelize.py says what it gets and what is checked
    after it); not with pipeline stages, and under parallel.on_rank_loss=replan a group of its ranks that
    loses one is dropped (re-forming cuts slices by the plan). In a worker process this
    call trains and then ends the process (it never returns there). Raises ConfigError on bad input.
    """
    from unbroken.runtime.launcher import launch
    from unbroken.runtime.trainer import lifecycle, placement

    custom = any(f is not None for f in (model, data, optimizer, lr_schedule, plan, parallelize))
    if placement.in_worker():
        d = placement.default_factories()
        factories = type(d)(model or d.model, data or d.data, optimizer or d.optimizer, lr_schedule, plan,
                            parallelize)
        code = lifecycle.run(factories)
        sys.stdout.flush()
        os._exit(code)
    cfg = make_config(config, **run)
    if data is not None and cfg.eval.every and cfg.eval.split:
        raise ConfigError(f"eval.split={cfg.eval.split} with a data factory of your own: it decides what training "
                          f"reads, so hold evaluation data out there and name it with eval.path")
    refused = check_host(cfg, model, plan, parallelize, data)
    cmd = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]] if custom else None
    return launch.launch(cfg, cmd, reform_refused=refused)
