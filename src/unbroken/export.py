"""`unbroken export RUN --hf DIR [--step S] [--config HF_CONFIG]`: a run's weights as a Hugging Face directory.

Owns: the subcommand (its parser and exit codes: 0 written, 2 bad input in one line) and `export_hf`, the
same as a function: the run's config and id, its checkpoint (runtime/persist/export.py), the names and
config.json of the Hugging Face layout (model/hfweights.py). Does not own: training, or checkpoints'
format. The directory holds config.json and model.safetensors, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads and `--model.init_from=DIR` starts from.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from unbroken.config import Config, ConfigError


def export_hf(run: str | Path, out: str | Path, step: int | None = None,
              hf_config: str | Path | None = None) -> tuple[int, Path]:
    """Write checkpoint `step` (None: the newest) of the run in directory `run` to `out` as a Hugging Face
    directory; returns (the step written, `out`). `hf_config`: the transformers config.json (or a directory
    holding one) of a model trained through hf.causal_lm; where None, that of the run's model.init_from.
    Raises ConfigError (one line) on a directory that is no run, a missing checkpoint or a model with no
    Hugging Face layout."""
    from unbroken.model import hfweights
    from unbroken.runtime.persist.export import read_params

    run = Path(run)
    if not (run / "config.json").is_file():
        raise ConfigError(f"{str(run)!r} is not a run directory (no config.json)")
    cfg = Config.from_json((run / "config.json").read_text())
    try:
        got, params = read_params(Path(cfg.checkpoint.dir or run / "checkpoints"), _run_id(run), step)
        source = hf_config or cfg.model.init_from or None
        config = None
        if source is not None and not hfweights.is_builtin_llama(params):
            path = Path(source)
            config = hfweights.read_config(path) if path.is_dir() else json.loads(path.read_text())
        weights, config = hfweights.to_hf(params, cfg.model, config)
        hfweights.write(out, weights, config)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    return got, Path(out)


def _run_id(run: Path) -> str | None:
    """The run's id from its run_start record (its checkpoints carry it), or None without one."""
    events = run / "events.jsonl"
    if events.is_file():
        with events.open() as f:
            for line in f:
                if '"run_start"' in line:
                    return json.loads(line).get("run_id")
    return None


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `export` on the top-level parser's subparsers."""
    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face directory (config.json, "
                                      "model.safetensors) that transformers loads",
                       epilog="Needs a checkpoint: train with --checkpoint.every=N (the last step is always saved).")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--hf", required=True, metavar="DIR", help="the directory to write")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--config", metavar="HF_CONFIG",
                   help="a model trained through unbroken.model.hf.causal_lm: its config.json or a directory "
                        "with one (default: the run's model.init_from)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace, rest: list[str]) -> int:
    step, out = export_hf(args.run_dir, args.hf, args.step, args.config)
    print(f"wrote step {step} of {args.run_dir} to {out}: transformers.AutoModelForCausalLM.from_pretrained"
          f"({str(out)!r}) loads it; --model.init_from={out} starts a run from it")
    return 0
