"""The picture of a whole run: one PNG of six panels over wall-clock time, for `unbroken report`, the demo and
the goodput benchmark.

Owns: drawing `Timeline`s with matplotlib (Agg). Does not own: reading runs (observe/report.py).
Panels, top to bottom, sharing the time axis (s since each run's own start): loss (references dashed; the
validation loss, where the run evaluates, as squares beside it),
committed tokens, live replica groups, seconds lost per recovery, microbatches redone, each replica's share
of the step's microbatches (its executed quota, stacked). Start-up (before the first commit) is grey. Faults are red dotted lines on every panel, named on the
first (a reference's faults: thin lines in its colour on the first two); recoveries are shaded from first
sign to commit. The PNG's "Description" text chunk lists the
panels and how many points each drew (JSON), so a reader (or a test) can check what it holds.
"""
from __future__ import annotations

import json
from pathlib import Path

from unbroken.observe.report import Timeline

PANELS = ("loss", "committed tokens", "live replica groups", "seconds lost per recovery", "microbatches redone",
          "microbatch share per replica")


def write_png(run: Timeline, refs: list[Timeline], png: str | Path, title: str | None = None) -> dict[str, int]:
    """Draw `run` (and `refs`, on the loss and tokens panels) into `png`; returns {panel: points drawn}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 15), dpi=100, sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 1.2, 1.5, 1.2, 1.8]})
    ax = dict(zip(PANELS, axes))
    drawn = dict.fromkeys(PANELS, 0)
    styles = ["--", ":", "-."]
    for n, r in enumerate([run, *refs]):
        style, lw = ("-", 1.8) if n == 0 else (styles[(n - 1) % 3], 1.4)
        if r.loss:
            xs, _, ys = zip(*r.loss)
            ax["loss"].plot(xs, ys, style, lw=lw, marker="o" if n == 0 else None, ms=2.5,
                            label=f"{r.name} (start-up {xs[0]:.1f} s)")
            drawn["loss"] += len(xs)
        if r.evals:  # validation loss beside the training loss, at the commit of the step evaluated
            xs, _, ys = zip(*r.evals)
            ax["loss"].plot(xs, ys, style, lw=lw, marker="s", ms=4, label=f"{r.name}: validation loss")
            drawn["loss"] += len(xs)
        xs, ys = zip(*r.tokens, (r.end, r.tokens[-1][1]))
        line, = ax["committed tokens"].step(xs, ys, style, where="post", lw=lw, label=r.name)
        drawn["committed tokens"] += len(xs)
        for at, _ in r.faults if n else ():  # a reference's own faults, in its colour, on its own clock
            for name in ("loss", "committed tokens"):
                ax[name].axvline(at, color=line.get_color(), ls=style, lw=0.8, alpha=0.6)
    if run.live:
        xs, ys = zip(*run.live, (run.end, run.live[-1][1]))
        ax["live replica groups"].step(xs, ys, where="post", color="tab:green", lw=1.8)
        ax["live replica groups"].set_ylim(-0.2, max(ys) + 0.5)
        ax["live replica groups"].yaxis.get_major_locator().set_params(integer=True)
        drawn["live replica groups"] = len(xs)
    done = [i for i in run.incidents if i.seconds is not None]
    for i in done:  # each bar spans its recovery, first sign to commit (at least 1/300 of the run, to be seen)
        width = max(i.seconds, run.end / 300)
        ax["seconds lost per recovery"].bar(i.start, i.seconds, width=width, color="tab:orange", align="edge")
        ax["seconds lost per recovery"].annotate(f"step {i.step}: {i.seconds:.2f} s ({i.cause})",
                                                 (i.start + width, i.seconds), fontsize=7, va="bottom")
        ax["microbatches redone"].bar(i.start, len(i.redo), width=width, color="tab:purple", align="edge")
    drawn["seconds lost per recovery"] = drawn["microbatches redone"] = len(done)
    if done:
        ax["seconds lost per recovery"].set_ylim(0, max(i.seconds for i in done) * 1.35)
        ax["microbatches redone"].set_ylim(0, max(len(i.redo) for i in done) + 1)
    pts = [p for p in run.shares.values() if p]
    if pts:  # stacked: each band is one replica's part of the step, the bands always fill the step
        # step s's split fills (commit of s-1, commit of s]: "pre"
        xs = [x for x, _ in pts[0]]
        bands = [[y for _, y in p] for p in pts]
        ax["microbatch share per replica"].stackplot(xs, bands, step="pre", alpha=0.8,
                                                     labels=[f"replica {r}" for r, p in run.shares.items() if p])
        drawn["microbatch share per replica"] = sum(len(p) for p in pts)
    ax["microbatch share per replica"].set_ylim(0, 1)
    top = ax["loss"]
    if run.loss:  # before the first commit: processes start, import torch, form groups
        for a in axes:
            a.axvspan(0, run.loss[0][0], color="grey", alpha=0.12, lw=0)
        top.annotate(f"start-up {run.loss[0][0]:.1f} s", (run.loss[0][0] / 2, 0.5), xycoords=("data", "axes fraction"),
                     ha="center", fontsize=9, color="dimgrey")
    for at, label in run.faults:
        for a in axes:
            a.axvline(at, color="red", ls=":", lw=1.2, alpha=0.8)
        top.annotate(label, (at, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                     fontsize=8, color="red")
    for i in run.incidents:
        for a in axes:
            a.axvspan(i.start, i.end if i.end is not None else run.end, color="orange", alpha=0.15, lw=0)
    for name, a in ax.items():
        a.set_ylabel(name, fontsize=9)
        a.grid(alpha=0.3)
        if name in ("loss", "committed tokens", "microbatch share per replica"):
            a.legend(fontsize=8, loc="upper left" if name == "committed tokens" else "upper right")
        if drawn[name] == 0:
            a.text(0.5, 0.5, "none in this run", transform=a.transAxes, ha="center", va="center", color="grey")
    firsts = [r.loss[0][0] for r in (run, *refs) if r.loss]
    squeezed = _squeeze_startup(axes[-1], min(firsts, default=0.0), max(r.end for r in (run, *refs)))
    axes[-1].set_xlabel("wall-clock seconds since run start" + (" (start-up, grey, drawn compressed)" if squeezed
                                                                 else " (start-up in grey)"))
    v = run.view
    fig.suptitle(title or f"{run.name}: {len(v.committed)} steps, {len(run.faults)} faults, "
                 f"{len(run.incidents)} recoveries ({sum(i.seconds or 0 for i in run.incidents):.2f} s lost)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(png, metadata={"Description": json.dumps(drawn)})
    plt.close(fig)
    return drawn


def _squeeze_startup(ax, first: float, end: float, share: float = 0.12) -> bool:
    """When start-up (0 .. `first` s, before any commit) is over 30% of the run, draw it in `share` of the axis
    width, the rest to scale: on a short run the training part would otherwise be a sliver. Returns whether."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    if end <= 0 or first <= 0.3 * end:
        return False
    k = share / (1 - share) * (end - first) / first  # start-up's scale factor

    def forward(x):
        x = np.asarray(x, dtype=float)
        return np.where(x < first, x * k, first * k + (x - first))

    def inverse(y):
        y = np.asarray(y, dtype=float)
        return np.where(y < first * k, y / k, y - first * k + first)

    ax.set_xscale("function", functions=(forward, inverse))
    ticks = [t for t in MaxNLocator(8).tick_values(first, end) if first + 0.04 * (end - first) < t <= end]
    ax.set_xticks([0.0, first, *ticks], ["0", f"{first:.1f}", *(f"{t:g}" for t in ticks)])
    ax.set_xlim(0, end * 1.01)
    return True
