"""What each `unbroken` subcommand does, given parsed arguments. Terminal output goes through rich.

Owns: train, resume, config, demo, compare, audit, report, status, prepare-data, coordinator and worker
as user-facing commands, each a parser and a run (`add_parsers`), with their exit codes (0 ok, 1 run
failed or runs differ, 2 bad input). Does not own: the top-level parser (cli.py) or any training logic.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.observe import plot as runplot
from unbroken.observe import report as runreport
from unbroken.observe import runs as report
from unbroken.api import check_host, make_config
from unbroken.config import SECTIONS, ConfigError, load, parse_overrides
from unbroken.observe.status import wide_console
from unbroken.events import read_events

console = Console()
# `unbroken train`'s own flags and the config keys they set
_TRAIN_FLAGS = {"replicas": "run.replicas", "steps": "run.steps", "microbatches": "run.microbatches",
                "exact": "run.exact", "faults": "faults.spec", "seed": "run.seed", "out": "launch.out"}


def train(args: argparse.Namespace, rest: list[str]) -> int:
    overrides = parse_overrides(rest)
    for flag, key in _TRAIN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.data is not None:
        overrides["data.path"] = args.data
    cfg = make_config(load(args.config, overrides))
    check_host(cfg)
    from unbroken.runtime.launcher.launch import launch
    result = launch(cfg)
    return _ran(result, cfg)


def resume(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken resume RUN_DIR`: continue a run that ended early (its coordinator lost, its launcher
    killed) in its own directory, from the agents' memory or the latest checkpoint (launcher/resume.py)."""
    from unbroken.runtime.launcher.launch import launch
    from unbroken.runtime.launcher.resume import read_run
    cfg, point = read_run(Path(args.run_dir), parse_overrides(rest))
    check_host(cfg)
    console.print(f"resuming {args.run_dir}: {point.reason}; last step in the log: {point.last_step}")
    result = launch(cfg, resume=point)
    return _ran(result, cfg)


def _ran(result, cfg) -> int:
    s = result.summary
    console.print(f"run dir: {result.run_dir}  steps committed: {s['steps_committed']}/{cfg.run.steps}  "
                  f"final loss: {s['final_loss']}  replicas lost: {s['members_lost']}"
                  + (f" (rejoined: {s['members_rejoined']})" if s.get("members_rejoined") else "")
                  + f"  seconds: {s['seconds']}")
    if not result.ok:
        print(f"unbroken: error: {result.error}", file=sys.stderr)
        return 1
    return 0


def coordinator(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken coordinator`: serve one run for torchrun jobs until it ends (runtime/coordinator/standalone.py)."""
    overrides = parse_overrides(rest)
    overrides["launch.out"] = args.out
    cfg = make_config(load(args.config, overrides))
    from unbroken.runtime.coordinator import standalone
    code = standalone.run(cfg, args.host, args.port, say=lambda line: print(line, flush=True))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the store's watch thread blocks in a C++ wait: no interpreter shutdown under it


def compare(a: str, b: str, rtol: float | None) -> int:
    """Exit 0 only if both runs are complete and every step matches (digests, or losses within rtol); 1
    if not; 2 (ConfigError) if either is no run (no events.jsonl, an empty one or one without run_start)
    or its log is corrupt (a line that does not parse, a step record lacking step, loss or param_digest)."""
    for d in (a, b):
        if not (Path(d) / "events.jsonl").is_file():
            raise ConfigError(f"{d!r} is not a run directory (no events.jsonl)")
    cmp = report.compare(a, b, rtol)  # a corrupt log: CorruptLog, a ConfigError (one line, exit 2)
    table = Table(title=f"{a}  vs  {b}")
    for col in ("step", "loss A", "loss B", "digest", f"rtol {rtol}" if rtol is not None else ""):
        table.add_column(col)
    for step, la, lb, same, close in cmp.rows:
        table.add_row(str(step), _f(la), _f(lb), "same" if same else "[red]differs", "ok" if close else "")
    console.print(table)
    for p in cmp.problems:
        print(f"incomplete: {p}")
    if rtol is not None:
        print(f"within rtol: {cmp.within}/{cmp.total} steps")
        return 0 if cmp.within == cmp.total and not cmp.problems else 1
    print(f"identical: {cmp.identical}/{cmp.total} steps" + (" (a run is incomplete)" if cmp.problems else ""))
    return 0 if cmp.identical == cmp.total and not cmp.problems else 1


def audit(run: str) -> int:
    """Exit 0 only if the run is complete and every microbatch of every step was reduced exactly once;
    1 if the audit finds problems in a run's log; 2 (ConfigError) if there is no run to audit: no
    events.jsonl, an empty one or one without run_start, a corrupt line, no usable config.json."""
    from unbroken.audit import audit_run, run_config
    if not (Path(run) / "events.jsonl").is_file():
        raise ConfigError(f"{run!r} is not a run directory (no events.jsonl)")
    try:
        config = run_config(run)
    except FileNotFoundError:
        raise ConfigError(f"{run!r} has no config.json: cannot tell what the run was meant to do") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problems = audit_run(run, config)  # a corrupt log: CorruptLog, a ConfigError (one line, exit 2)
    if problems:  # one of them may be that the log holds no run at all: bad input, not a finding
        report.run_start(read_events(run), run)
    for p in problems:
        print(p)
    print(f"audit: {len(problems)} problems")
    return 0 if not problems else 1


def report_run(run: str, compare: list[str], png: str | None) -> int:
    """`unbroken report`: the picture of a finished run (beside its references) and the same figures as tables."""
    main = runreport.timeline(run)
    refs = [runreport.timeline(r, f"ref {Path(r).name}" if Path(r).name == main.name else None) for r in compare]
    target = Path(png) if png else Path(run) / "report.png"
    if not target.parent.is_dir():
        raise ConfigError(f"--png {png!r}: no such directory {str(target.parent)!r}")
    drawn = runplot.write_png(main, refs, target)
    wide = wide_console(140)  # the tables have ~12 columns: not squeezed to rich's 80 in a pipe
    wide.print(runreport.summary_table([main, *refs]))
    wide.print(runreport.recovery_table(main))
    wide.print(runreport.step_table(main, refs))
    wide.print("panels: " + ", ".join(f"{k} ({n})" for k, n in drawn.items()))
    wide.print(f"plot: {target}")
    return 0


def demo(out: Path, steps: int, replicas: int) -> int:
    """A failure-free reference and a run that loses half its replicas, in --exact mode, side by side."""
    lost = list(range(1, replicas, 2))[: max(1, replicas // 2)]
    phases = ["allreduce", "compute", "commit", "optimizer"]
    faults = "; ".join(f"kill:replica={r},step={max(1, (n + 1) * steps // (len(lost) + 1))},phase={phases[n % 4]}"
                       for n, r in enumerate(lost))
    console.rule(f"[bold]unbroken demo: {replicas} replicas, {steps} steps, exact mode")
    console.print(f"faulty run injects: {faults}")
    from unbroken.runtime.launcher.launch import launch
    runs = {}
    for name, spec in (("reference", ""), ("faulty", faults)):
        cfg = make_config(None, replicas=replicas, steps=steps, microbatches=8, exact=True, faults=spec,
                          out=str(out / name))
        result = launch(cfg, title=name)
        if not result.ok:
            print(f"unbroken: error: {name} run failed: {result.error}", file=sys.stderr)
            return 1
        runs[name] = result
    cmp = report.compare(out / "reference", out / "faulty")
    table = Table(title="failure-free reference vs. a run that loses half its replicas")
    for col in ("step", "reference loss", "faulty loss", "replicas", "param digest"):
        table.add_column(col, justify="right")
    faulty_steps = report.steps(read_events(out / "faulty"))
    for step, la, lb, same, _ in cmp.rows:
        table.add_row(str(step), _f(la), _f(lb), str(faulty_steps[step]["replicas"]),
                      "[green]identical" if same else "[red]differs")
    console.print(table)
    png = out / "report.png"
    runplot.write_png(runreport.timeline(out / "faulty", "loses half its replicas"),
                      [runreport.timeline(out / "reference", "failure-free")], png,
                      title=f"unbroken demo: {len(lost)} of {replicas} replicas killed (red lines), exact mode")
    for name, r in runs.items():
        s = r.summary
        console.print(f"{name}: {s['seconds']:.1f} s, {s['members_lost']} replicas lost, "
                      f"{s['recoveries']} in-step recoveries, final digest {s['final_param_digest'][:16]}")
    console.print(f"plot: {png}")
    print(f"identical: {cmp.identical}/{cmp.total} steps")
    return 0 if cmp.identical == cmp.total else 1


def config(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken config`: every key, one a line (`section.key  type  default  doc`); with a FILE.toml or
    overrides, the values that config resolves to instead, as TOML dotted keys; `--markdown`: docs/config.md."""
    from unbroken.config import listing
    overrides = parse_overrides(rest)
    if args.markdown:
        if args.file or overrides:
            raise ConfigError("--markdown lists the keys: it takes no FILE or --section.key=value")
        print(listing.markdown(), end="")
    elif args.file or overrides:
        print("\n".join(listing.resolved(load(args.file, overrides))))
    else:
        print("\n".join(listing.listing()))
    return 0


def prepare_data(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken prepare-data FILES... --out DIR [--tokenizer tokenizer.json]`: text into llm.c shards
    (model/data/prepare.py), with a progress bar; says what it wrote and the keys to train on it."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from unbroken.model.data.prepare import Tokenizer, prepare
    files = [Path(f) for f in args.files]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{str(f)!r}: no such file")
    if args.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens {args.shard_tokens}: need at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out!r}: not a directory")
    try:
        tokenizer = Tokenizer(args.tokenizer, args.eos)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with Progress("tokenizing", BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("", total=sum(f.stat().st_size for f in files))
        done = prepare(files, out, tokenizer, split=args.split, shard_tokens=args.shard_tokens,
                       progress=lambda n: bar.advance(task, n))
    console.print(f"wrote {done.tokens:,} tokens, {done.documents:,} documents in {len(done.shards)} "
                  f"{done.dtype} llm.c shard(s) to {out}")
    console.print(f"train on them with: --data.path='{out}/shard_*.bin' --model.vocab_size={done.vocab_size} "
                  f"--data.eos={done.eos}", soft_wrap=True)
    return 0


def add_parsers(sub) -> None:
    """Register train, resume, config, demo, compare, audit, report, status, prepare-data, coordinator and worker on the top-level
    parser's subparsers; each parser's `run(args, rest)` returns the exit code."""
    overrides = ("Any config key can be set with --section.key=value, e.g. --model.n_layer=4; `unbroken config` "
                 "lists every key with its type, default and meaning.")
    tables = f"TOML file with {', '.join(f'[{name}]' for name in SECTIONS)} tables"
    t = sub.add_parser("train", help="train with fault tolerance; writes OUT/events.jsonl and summary.json",
                       epilog=overrides)
    t.add_argument("--config", help=tables)
    t.add_argument("--replicas", type=int)
    t.add_argument("--steps", type=int)
    t.add_argument("--microbatches", type=int)
    t.add_argument("--exact", action="store_true", default=None, help="bitwise the failure-free trajectory")
    t.add_argument("--faults", help="e.g. 'kill:replica=1,step=10,phase=allreduce; hang:replica=2,step=14,for=8'")
    t.add_argument("--seed", type=int)
    t.add_argument("--data", help="token files (a file or a quoted glob: llm.c, Megatron .bin/.idx, raw .bin) "
                                  "or a text file (default: Python's stdlib source)")
    t.add_argument("--out", help="run directory (default runs/latest)")
    t.set_defaults(run=train, overrides=True)
    cf = sub.add_parser("config", help="every config key with its type, default and meaning; or the values a "
                                       "config resolves to", epilog="With FILE.toml and/or --section.key=value: "
                                       "the resolved value of every key, as TOML.")
    cf.add_argument("file", nargs="?", metavar="FILE.toml", help="a config file to resolve")
    cf.add_argument("--markdown", action="store_true", help="the key list as Markdown (docs/config.md)")
    cf.set_defaults(run=config, overrides=True)
    rs = sub.add_parser("resume", help="continue a run that ended early, in its directory, from memory or disk",
                        epilog="Only --coord.* (--coord.run_timeout among them), --metrics.*, --launch.progress and "
                               "--run.threads may be overridden: the rest is the run's.")
    rs.add_argument("run_dir", metavar="RUN_DIR")
    rs.set_defaults(run=resume, overrides=True)
    c = sub.add_parser("compare", help="compare two runs step by step")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--rtol", type=float)
    c.set_defaults(run=lambda args, rest: compare(args.a, args.b, args.rtol))
    d = sub.add_parser("demo", help="a failure-free run and one that loses half its replicas, side by side")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--steps", type=int, default=24)
    d.add_argument("--replicas", type=int, default=4)
    d.set_defaults(run=lambda args, rest: demo(Path(args.out), args.steps, args.replicas))
    a = sub.add_parser("audit", help="check that every committed step reduced each microbatch exactly once")
    a.add_argument("run_dir", metavar="run")
    a.set_defaults(run=lambda args, rest: audit(args.run_dir))
    rp = sub.add_parser("report", help="a PNG of a whole run over wall-clock time, and its figures as tables")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--compare", action="append", default=[], metavar="REF_DIR",
                    help="a reference run drawn beside it (repeatable)")
    rp.add_argument("--png", help="where to write the picture (default RUN_DIR/report.png)")
    rp.set_defaults(run=lambda args, rest: report_run(args.run_dir, args.compare, args.png))
    st = sub.add_parser("status", help="one screen of a running job (HOST:PORT of its coordinator) or a run dir")
    st.add_argument("target", metavar="ADDR|RUN_DIR")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until the run ends")
    st.set_defaults(run=status)
    k = sub.add_parser("coordinator", help="serve a run's coordinator for torchrun jobs (docs/cluster.md)",
                       epilog=overrides)
    k.add_argument("--config", help=tables)
    k.add_argument("--out", required=True, help="run directory (shared by the workers' hosts)")
    k.add_argument("--host", help="address to bind: the cluster's private interface (default 127.0.0.1; "
                                  "not with --coord.store)")
    k.add_argument("--port", type=int, help="port to bind (default 29400; not with --coord.store)")
    k.set_defaults(run=coordinator, overrides=True)
    pd = sub.add_parser("prepare-data", help="tokenize text files into llm.c token shards for --data.path",
                        epilog="Nothing is downloaded: the tokenizer is a local tokenizer.json.")
    pd.add_argument("files", nargs="+", metavar="FILES", help="text files (UTF-8)")
    pd.add_argument("--out", required=True, help="directory for shard_000000.bin, ...")
    pd.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: byte-level, ids 0..255)")
    pd.add_argument("--eos", type=int, help="end-of-document id (default: the tokenizer's <|endoftext|>, </s>, "
                                            "<eos> or <|end_of_text|>; byte-level: 0)")
    pd.add_argument("--split", choices=("file", "blank-lines"), default="file",
                    help="a document is a whole file (default) or each block between blank lines")
    pd.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard at most")
    pd.set_defaults(run=prepare_data)
    w = sub.add_parser("worker", help="one rank of a replica group: run it under torchrun")
    w.add_argument("--coordinator", required=True,
                   help="host:port that `unbroken coordinator` printed, or its etcd://... store")
    w.add_argument("--group", type=int, required=True, help="this torchrun job's replica group (0 .. replicas-1)")
    w.set_defaults(run=worker)


def status(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken status ADDR|RUN_DIR [--watch S]` (observe/status.py)."""
    from unbroken.observe import status as screen
    from unbroken.runtime.coordinator.status import load
    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: must be a positive number of seconds")
    return screen.show(args.target, args.watch, load)


def worker(args: argparse.Namespace, rest: list[str]) -> int:
    """`unbroken worker`: the same process as `python -m unbroken.runtime.trainer` (it never returns)."""
    from unbroken.runtime.trainer import lifecycle as entry
    entry.main(["--coordinator", args.coordinator, "--group", str(args.group)])
    return 1  # not reached: the worker ends its process


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"
