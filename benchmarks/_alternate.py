"""Runs of unbroken's own launcher, one per configuration, alternated round by round (a benchmark helper).

Owns: launching each configuration of a comparison in turn, `rounds` times (so that a noisy stretch of
this shared host hits every configuration alike), failing loudly on a run that fails, and handing each
run's event log to the benchmark's `measure`. Does not own: what is measured or printed at the end.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from unbroken.api import make_config
from unbroken.events import read_events
from unbroken.runtime.launcher.launch import launch


def alternate(rounds: int, modes: dict[str, dict], base: dict, title: str,
              measure: Callable[[list[dict]], dict], show: Callable[[int, str, dict], str]) -> dict[str, list[dict]]:
    """For each round, for each mode: launch `base` updated with the mode's settings (make_config keywords),
    measure its events, print `show(round, mode, measured)`. Returns mode -> each round's measurement.
    Raises SystemExit naming the run directory when a run fails."""
    got: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix=f"{title.replace(' ', '-')}-") as tmp:
        for rnd in range(rounds):
            for mode, extra in modes.items():
                out = Path(tmp) / f"{mode}-{rnd}"
                result = launch(make_config(**base, **extra, launch__out=str(out)), title=f"{title} {mode}")
                if not result.ok:
                    raise SystemExit(f"run failed: {result.error} (see {out})")
                got[mode].append(measure(read_events(out / "events.jsonl")))
                print(show(rnd, mode, got[mode][-1]), flush=True)
    return got


def add_pipeline_args(ap) -> None:
    """The model-shape options of a 2 groups x PP 2 benchmark (argparse)."""
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=64, help="fixed tokens per sequence (= block size)")


def pipeline_base(args, faults: str, **extra) -> dict:
    """make_config keywords of 2 groups x PP 2 in --exact (a 2-layer GPT, dropout 0) under `faults`."""
    return dict(replicas=2, steps=args.steps, microbatches=args.microbatches, launch__progress=False, exact=True,
                faults__spec=faults, parallel__group_size=2, parallel__pp=2, model__n_layer=2,
                model__n_embd=args.n_embd, model__block_size=args.seq_len, model__dropout=0.0, data__batch_size=args.batch_size,
                data__seq_len=str(args.seq_len), **extra)
