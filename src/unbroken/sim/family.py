"""A scenario family (one job at several cluster sizes): one table and one plot of every strategy across it.

Owns: the family's rows (per scenario and strategy: GPUs, tokens, tokens over checkpoint_restart's,
GPU-hours of the run, useful and lost), the markdown table, and family.png (tokens as a share of the
failure-free run's, and GPU-hours lost as a share of the run's, against cluster size). Does not own:
running the simulations (cli.py, runner.py) or a single scenario's plots (plots.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.policy import workload
from unbroken.sim.scenario import Scenario

BASELINE = "checkpoint_restart"


def step_seconds(sc: Scenario) -> float:
    """The failure-free step on every replica group (as strategies/base.py takes it), s."""
    w = sc.workload
    return max(workload.quotas(w.microbatches, range(sc.cluster.dp)).values()) * w.microbatch_seconds + w.sync_seconds


@dataclass(frozen=True)
class Row:
    scenario: str
    gpus: int
    strategy: str
    tokens: int
    failure_free_tokens: float  # what the run's hours would commit without a failure
    gpu_hours: float
    lost_gpu_hours: float
    over_baseline: float  # tokens / checkpoint_restart's tokens in the same scenario (nan if absent)


def rows(scenario: str, gpus: int, step_seconds: float, step_tokens: int, ends: dict[str, dict[str, Any]]
         ) -> list[Row]:
    """Rows of one scenario from each strategy's run_end record (`ends`: strategy -> record)."""
    base = ends.get(BASELINE, {}).get("tokens")
    out = []
    for name, end in ends.items():
        free = end["seconds"] / step_seconds * step_tokens
        out.append(Row(scenario, gpus, name, end["tokens"], free, end["gpu_hours"],
                       sum(end["lost_gpu_hours"].values()), end["tokens"] / base if base else float("nan")))
    return out


def markdown(table: list[Row]) -> str:
    """The family table in markdown, one line per scenario and strategy, scenarios by size."""
    lines = ["| GPUs | strategy | tokens | of failure-free | over checkpoint_restart | GPU-hours | lost GPU-hours | lost share |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(table, key=lambda r: (r.gpus, r.scenario)):
        lines.append(f"| {r.gpus:,} | {r.strategy} | {r.tokens:.4g} | {r.tokens / r.failure_free_tokens:.3f} | "
                     f"{r.over_baseline:.3f}x | {r.gpu_hours:,.0f} | {r.lost_gpu_hours:,.0f} | "
                     f"{r.lost_gpu_hours / r.gpu_hours:.3f} |")
    return "\n".join(lines)


def plot(table: list[Row], path: str | Path, title: str) -> Path:
    """Write family.png: per strategy, tokens as a share of failure-free and lost GPU-hours as a share of
    the run, against the cluster's GPUs (log axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in dict.fromkeys(r.strategy for r in table):
        pts = sorted((r.gpus, r.tokens / r.failure_free_tokens, r.lost_gpu_hours / r.gpu_hours)
                     for r in table if r.strategy == name)
        xs = [p[0] for p in pts]
        a.plot(xs, [p[1] for p in pts], marker="o", label=name)
        b.plot(xs, [p[2] for p in pts], marker="o", label=name)
    for ax, ylabel in ((a, "tokens / failure-free tokens"), (b, "GPU-hours lost / GPU-hours")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.gpus for r in table}), [f"{g:,}" for g in sorted({r.gpus for r in table})])
        ax.set(xlabel="GPUs", ylabel=ylabel)
        ax.grid(alpha=0.3)
    a.set_title(f"{title}: tokens committed")
    b.set_title(f"{title}: GPU-hours lost")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
