"""The values each numeric key of the config tree can take, by its meaning: a count of at least one, a
probability below one, a timeout in seconds a timer can hold. Checked first, key by key, before any check
that combines keys divides by one of them (tree.validate), so a zero or a nan never reaches arithmetic.

Owns: `DOMAINS` (every int and float key of schema.py, a test keeps it complete) and `domain_problem`.
Does not own: the checks across keys (tree.py) or what the host can hold (api.check_host).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BIG = 10 ** 9  # a count no run reaches: steps, windows, restarts
SECONDS = 1e7  # ~115 days: the longest timeout a timer (datetime.timedelta, a TCPStore's) is given


@dataclass(frozen=True)
class Range:
    """lo..hi, each end closed unless marked open; `why` is the key's meaning in a few words."""
    lo: float
    hi: float
    why: str
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        return (self.lo < v if self.lo_open else self.lo <= v) and (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        def end(x: float) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"
        return f"{'(' if self.lo_open else '['}{end(self.lo)}, {end(self.hi)}{')' if self.hi_open else ']'}"


def _count(lo: int = 1, hi: int = BIG, why: str = "a count") -> Range:
    return Range(lo, hi, why)


def _seconds(lo: float = 0.0, why: str = "seconds", lo_open: bool = True) -> Range:
    return Range(lo, SECONDS, why, lo_open=lo_open)


_POSITIVE = Range(0.0, 1e15, "a positive quantity", lo_open=True)
_RATIO = Range(1.0, 100.0, "a slowdown ratio")
_LEVEL = Range(0.0, 100.0, "a CUSUM level in log units", lo_open=True)
_SIGMAS = Range(0.0, 1000.0, "a multiple of the measured noise", lo_open=True)

DOMAINS: dict[str, Range] = {
    "run.replicas": _count(hi=65536, why="replica groups"),
    "run.steps": _count(why="steps"),
    "run.microbatches": _count(hi=10 ** 6, why="microbatches a step"),
    "run.seed": _count(0, 2 ** 63 - 1, "a seed"),
    "run.threads": _count(hi=1024, why="torch threads"),
    "launch.restarts": _count(0, why="torchrun restarts"),
    "launch.max_job_restarts": _count(0, why="whole-job restarts"),
    "snapshot.every": _count(why="steps between snapshots"),
    "snapshot.nodes": _count(hi=65536, why="nodes"),
    "snapshot.k": _count(0, 255, "data shards a stripe"),
    "snapshot.m": _count(0, 255, "parity shards a stripe"),
    "checkpoint.every": _count(0, why="steps between checkpoints (0: none)"),
    "model.n_layer": _count(hi=10 ** 4, why="blocks"),
    "model.n_head": _count(hi=10 ** 4, why="heads"),
    "model.n_embd": _count(hi=10 ** 6, why="the width"),
    "model.block_size": _count(2, 10 ** 7, "tokens"),
    "model.vocab_size": _count(hi=2 ** 31 - 1, why="token ids"),
    "model.dropout": Range(0.0, 1.0, "a probability", hi_open=True),
    "model.n_kv_head": _count(0, 10 ** 4, "key/value heads (0: model.n_head)"),
    "model.ffn_dim_multiplier": Range(0.0, 100.0, "a multiplier (0: 1)"),
    "model.intermediate_size": _count(0, 10 ** 7, "the SwiGLU width (0: from the multiplier)"),
    "model.rope_theta": Range(0.0, 1e12, "a base", lo_open=True),
    "data.eos": _count(-1, 2 ** 31 - 1, "a token id (-1: none)"),
    "data.batch_size": _count(hi=10 ** 6, why="sequences a microbatch"),
    "data.ignore_index": _count(-(2 ** 31), -1, "a negative id"),
    "data.max_files": _count(hi=10 ** 6, why="files"),
    "optim.lr": Range(0.0, 10.0, "a learning rate", lo_open=True),
    "optim.weight_decay": Range(0.0, 1e6, "a decay coefficient"),
    "optim.beta1": Range(0.0, 1.0, "a decay rate", hi_open=True),
    "optim.beta2": Range(0.0, 1.0, "a decay rate", hi_open=True),
    "optim.warmup_steps": _count(0, why="steps"),
    "optim.decay_steps": _count(0, why="steps"),
    "optim.min_lr_ratio": Range(0.0, 1.0, "a fraction of lr"),
    "optim.max_grad_norm": Range(0.0, 1e12, "a norm (0: no clipping)"),
    "coord.heartbeat_interval": _seconds(),
    "coord.heartbeat_timeout": _seconds(),
    "coord.startup_timeout": _seconds(),
    "coord.progress_timeout": _seconds(),
    "coord.collective_timeout": _seconds(),
    "coord.run_timeout": _seconds(),
    "coord.standbys": _count(0, 64, "standby coordinators"),
    "coord.lease_ttl": _count(1, 86400, "whole seconds"),
    "metrics.port": _count(0, 65535, "a TCP port (0: off)"),
    "parallel.group_size": _count(hi=65536, why="ranks a group"),
    "parallel.pp": _count(hi=1024, why="stages"),
    "parallel.tp": _count(hi=1024, why="a degree"),
    "parallel.replace_after": Range(-SECONDS, SECONDS, "seconds (< 0: never)"),
    "parallel.claim_wait": _seconds(lo_open=False),
    "parallel.bucket_mb": Range(0.0, 1e6, "MB", lo_open=True),
    "detector.drift_ratio": _RATIO,
    "detector.suspect_at": _LEVEL,
    "detector.slow_at": _LEVEL,
    "detector.max_increment": _LEVEL,
    "detector.recover_below_ratio": _RATIO,
    "detector.recover_steps": _count(why="steps"),
    "detector.regime_move_ratio": _RATIO,
    "detector.regime_quorum": Range(0.0, 1.0, "a share", lo_open=True, hi_open=True),
    "detector.min_fleet": _count(why="replicas"),
    "detector.speed_window": _count(why="steps"),
    "detector.min_speed": Range(0.0, 1.0, "a speed", lo_open=True),
    "detector.warmup_steps": _count(0, why="steps"),
    "detector.warmup_drift_ratio": _RATIO,
    "detector.join_skip": _count(0, why="steps"),
    "detector.design_noise": Range(0.0, 10.0, "a log-sd", lo_open=True),
    "detector.noise_window": _count(16, why="steps"),
    "detector.noise_cap": Range(1.0, 1000.0, "a multiple of the fleet's noise"),
    "detector.drift_sigmas": _SIGMAS,
    "detector.suspect_sigmas": _SIGMAS,
    "detector.slow_sigmas": _SIGMAS,
    "detector.recover_sigmas": _SIGMAS,
    "detector.predictor_window": _count(3, why="timings"),
    "detector.refit_every": _count(why="timings"),
    "detector.min_samples": _count(3, why="timings"),
    "detector.replay_steps": _count(why="steps"),
    "detector.locate_steps": _count(why="steps"),
    "eval.every": _count(0, why="steps between evaluations (0: never)"),
    "eval.microbatches": _count(hi=10 ** 6, why="microbatches an evaluation"),
    "eval.split": Range(0.0, 1.0, "a fraction of the training data", hi_open=True),
    "detect.state_every": _count(0, why="steps between state checks (0: never)"),
    "detect.evict_after": _count(0, why="times a device is found corrupted before it is evicted (0: never)"),
    "detect.recompute_fraction": Range(0.0, 1.0, "a share of each step's microbatches"),
    "hardware.tp_bytes_per_s": _POSITIVE,
    "hardware.pp_bytes_per_s": _POSITIVE,
    "hardware.peer_bytes_per_s": _POSITIVE,
    "hardware.state_budget_bytes": _POSITIVE,
    "hardware.reform_seconds": _seconds(lo_open=False),
}


def domain_problem(key: str, value: float) -> str | None:
    """Why `value` is no value of numeric key `key` (None: it is, or the key has no domain here): one line
    naming the key, the value and the range. Call for each numeric key before any check combines them."""
    r = DOMAINS.get(key)
    if r is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}={value}: must be a finite number in {r.text()} ({r.why})"
    if not r.holds(value):
        return f"{key}={value}: must be in {r.text()} ({r.why})"
    return None
