"""What the experiment trackers get from the coordinator, and the Weights & Biases one.

Owns: `figures`, the one list of scalars and texts that TensorBoard and W&B both receive from the records the
run view folded (per committed step: loss, lr, grad_norm, live replicas, committed tokens, tokens/s, the
evaluation loss; per recovery its seconds and redone microbatches; faults and membership changes as text),
and `WandbRun`, which logs them to one W&B run per unbroken run: its id is the run's id, so a resumed run
(`unbroken resume`, a new coordinator reading the log from the start) continues the same W&B run and skips
what it logged before (RUN_DIR/wandb.json keeps the newest record time logged). Does not own: folding the
log (observe/view.py), TensorBoard's writer or Prometheus (metrics.py).

wandb is an optional extra (`pip install 'unbroken[wandb]'`), imported only with --metrics.wandb. It honours
its own environment (WANDB_MODE=offline writes RUN_DIR/wandb/ and never reaches a server; WANDB_API_KEY,
WANDB_ENTITY).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One point for a tracker: a scalar (`value` a float) or a text (`value` a str), at training step `step`
    (the interrupted step for a recovery), wall time `t` (s since the epoch)."""
    tag: str
    value: float | str
    step: int
    t: float


def figures(shown: list[tuple[str, dict[str, Any]]], view) -> list[Figure]:
    """The trackers' points for the records the view just folded (`RunView.feed`'s answer); the run-wide
    figures (committed tokens, tokens/s) are the view's as it stands after them."""
    out: list[Figure] = []
    for kind, r in shown:
        if kind == "step":
            s, t = r["step"], r["t"]
            out.append(Figure("loss", r["loss"], s, t))
            out += [Figure(key, r[key], s, t) for key in ("lr", "grad_norm") if r.get(key) is not None]
            out.append(Figure("live_replicas", r["replicas"], s, t))
            out.append(Figure("committed_tokens", view.tokens, s, t))
            tps = view.tokens_per_second()
            if tps is not None:
                out.append(Figure("tokens_per_second", tps, s, t))
        elif kind == "eval":
            out.append(Figure("validation/loss", r["loss"], r["step"], r["t"]))
        elif kind == "incident":
            s, t = r["step"], r["start"]
            out += [Figure("recovery/seconds", r["seconds"], s, t),
                    Figure("recovery/redone_microbatches", r["redone"], s, t),
                    Figure("recoveries", f"step {s}: {r['cause']}, {r['seconds']:.3f} s lost, "
                                         f"{r['redone']} microbatches redone", s, t)]
        elif kind == "fault":
            detail = ", ".join(f"{k}={r[k]}" for k in ("replica", "node", "phase") if r.get(k) is not None)
            out.append(Figure("faults", f"{r['kind']} at step {r.get('step')}: {detail}", r.get("step") or 0, r["t"]))
    return out


class WandbRun:
    """One W&B run per unbroken run, started at the first figure (the run's id comes from its log). Call
    `log` with each poll's figures and `close` once; errors propagate to the exporter, which reports them once
    and trains on."""

    def __init__(self, project: str, run_dir: str | Path):
        self.project, self.run_dir = project, Path(run_dir)
        self.state_file = self.run_dir / "wandb.json"
        self.before = self.newest = float("-inf")  # record times: logged by an earlier coordinator; by this one
        self.run = None

    def _start(self, run_id: str, config: dict | None) -> None:
        import wandb  # ~0.5 s: only a run that asks for W&B pays it

        self.run = wandb.init(project=self.project, id=run_id, name=self.run_dir.name, resume="allow",
                              dir=str(self.run_dir), config=config, settings=wandb.Settings(silent=True))
        # figures go on the training step's axis: a recovery is logged at the step it interrupted, after
        # that step's record, which W&B's own monotonic step would drop
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, points: list[Figure], run_id: str | None) -> None:
        """Log `points` (each record's once: the view shows each record once). Those of records older than
        what an earlier coordinator of the same run logged are skipped: a resumed coordinator reads the log
        from its start, and every record before the resume is older than every record after it."""
        if not points or run_id is None:
            return
        if self.run is None:
            # what this run's earlier coordinator logged (a file of another run in this directory: nothing)
            state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
            self.before = state["t"] if state.get("id") == run_id else float("-inf")
        fresh = [p for p in points if p.t > self.before]
        if not fresh:
            return
        if self.run is None:
            self._start(run_id, _config(self.run_dir))
        by_step: dict[int, dict[str, Any]] = {}
        for p in fresh:  # a step's record may follow a later step's fault or recovery: grouped by step
            key = f"events/{p.tag}" if isinstance(p.value, str) else p.tag
            by_step.setdefault(p.step, {})[key] = p.value
        for step in sorted(by_step):
            self.run.log({"step": step, **by_step[step]})
        self.newest = max(self.newest, max(p.t for p in fresh))
        tmp = self.state_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"id": run_id, "t": self.newest}))
        os.replace(tmp, self.state_file)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _config(run_dir: Path) -> dict | None:
    """The run's config tree (RUN_DIR/config.json) as W&B's run config, or None where it is not there."""
    path = run_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
