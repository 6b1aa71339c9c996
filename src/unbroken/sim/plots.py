"""PNG plots of simulated (or real) runs with matplotlib's Agg backend.

Owns: committed tokens over time, effective throughput per interval, and lost GPU-hours by cause, one
figure each, written next to the run. Does not own: the numbers (summary.py).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from unbroken.sim.summary import Summary  # noqa: E402


def write_plots(summaries: list[Summary], out: str | Path, title: str) -> list[Path]:
    """Write tokens.png, throughput.png and lost.png under `out`; returns their paths."""
    out = Path(out)
    paths = [out / "tokens.png", out / "throughput.png", out / "lost.png"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in summaries:
        ax.plot([p[0] / 3600 for p in s.curve], [p[1] for p in s.curve], label=s.strategy)
    ax.set(xlabel="hours", ylabel="committed tokens", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in summaries:
        pts = [(0.0, 0, 0.0), *s.curve]
        xs, ys = [], []
        for a, b in zip(pts, pts[1:]):
            if b[0] - a[0] >= 1e-9:
                xs.append(b[0] / 3600)
                ys.append((b[1] - a[1]) / (b[0] - a[0]))
        ax.step(xs, ys, where="pre", label=s.strategy)
    ax.set(xlabel="hours", ylabel="tokens / s between records", title=f"{title}: effective throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    causes = sorted({c for s in summaries for c in s.lost_gpu_hours})
    bottom = [0.0] * len(summaries)
    for c in causes:
        vals = [max(0.0, s.lost_gpu_hours.get(c, 0.0)) for s in summaries]
        ax.bar([s.strategy for s in summaries], vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="GPU-hours lost", title=f"{title}: GPU-hours lost by cause")
    ax.tick_params(axis="x", rotation=20)
    if causes:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths
