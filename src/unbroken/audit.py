"""The audit of a real run's log: complete, and every microbatch of every step reduced exactly once.

Owns: what "nothing lost, nothing counted twice" means for a log, checked from the records alone:
  - the log: every line parses except at most a torn last line (reported as a problem, not skipped
    silently); any other line that does not parse, or a record without the fields read here, makes
    the log unreadable (CorruptLog), not merely faulty; it holds `run_start`, and the run ended with
    `run_end ok` (a run that did not finish is a failure);
  - the run directory's config.json is this run's (its replicas, steps, microbatches, seed, exact and
    faults are those of `run_start`);
  - completeness: every step 0..N-1 has a step record; a step redone after a whole-job restart has one
    copy per generation that committed it, and each copy is checked; two copies in one generation are
    a problem;
  - exactly once: each copy's owners cover microbatches 0..M-1, each once, and the owners are the
    commit epoch's members;
  - each generation's copies are contiguous from its first step to its last, a later generation's
    first copy is the step after the one its trainers restored (`restored`; step 0 where it started
    over), and the last generation reaches step N-1: a restart that rolled back to step n and then
    lost the record of a step after n is incomplete even where an earlier generation's copy exists;
  - the owners did what the record says: each owner computed, in that step and generation, every
    microbatch it is credited with (its `compute` records), and reduced in the commit epoch (its
    `reduce ok` record) exactly the microbatches it is credited with (the record's `microbatches`,
    written by the member itself, where the coordinator wrote the owners); otherwise a microbatch was
    credited without being computed, or reduced without being credited;
  - every member applied the same parameters (`applied` digests of the step and generation agree).
Does not own: reading the log (events.py), comparing two runs (report.compare), or simulated logs
(sim/audit.py).

A generation is the stretch of the log between whole-job restarts: the launcher writes `restart` only
after every trainer of the generation before is dead, so records after the k-th `restart` are
generation k's.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError, upgrade
from unbroken.events import CorruptLog, read_log

# run_start fields that config.json must repeat, and the config key of each
_SAME = {"replicas": "run.replicas", "steps": "run.steps", "microbatches": "run.microbatches", "exact": "run.exact",
         "seed": "run.seed", "faults": "faults.spec"}


def audit_run(path: str | Path, config: dict[str, Any] | None = None, microbatches: int | None = None) -> list[str]:
    """Audit one run: `path` a run directory or its events.jsonl; `config` its config.json (as a dict, in
    the current layout: run_config), checked against `run_start` when given; `microbatches` M, else run_start's.
    Returns one line per problem (empty: complete and exactly once). Raises FileNotFoundError if there
    is no log, CorruptLog (one line) if a line other than a torn last one does not parse or a record
    lacks a field the audit reads: such a log is not one the product wrote."""
    log = read_log(path)
    problems: list[str] = []
    if log.torn is not None:
        problems.append(f"torn last line (a writer died mid-record): {log.torn.strip()[:60]!r}")
    records = log.records
    start = next((r for r in records if r["event"] == "run_start"), None)
    if start is None:
        return problems + ["no run_start record: not the log of a run (empty or truncated)"]
    if config is not None:
        for key, dotted in _SAME.items():
            section, _, name = dotted.partition(".")
            table = config.get(section)
            value = table.get(name) if isinstance(table, dict) else None
            if key in start and value != start[key]:
                problems.append(f"config.json is not this run's: {dotted} = {value!r}, "
                                f"the log's run_start says {start[key]!r}")
    end = next((r for r in reversed(records) if r["event"] == "run_end"), None)  # the last: after a resume
    if end is None:
        problems.append("the run did not finish: no run_end record")
    elif not end.get("ok"):
        problems.append(f"the run failed: {end.get('error')}")
    try:
        n_steps, m = start["steps"], microbatches if microbatches is not None else start["microbatches"]
        problems += _exactly_once(records, n_steps, m, range(start.get("group_size", 1)))
    except (KeyError, TypeError, AttributeError) as e:  # a hand-edited or foreign record
        raise CorruptLog(f"{path}: a record lacks a field or has the wrong type ({type(e).__name__}: {e})") from None
    return problems


def _exactly_once(records: list[dict[str, Any]], n_steps: int, m: int, ranks: range = range(1)) -> list[str]:
    # A replica group of several ranks: each rank computes its share of the group's microbatches and
    # reduces (and applies) its own shard, so each check below holds per rank.
    computed: dict[tuple, set[int]] = defaultdict(set)  # (gen, step, replica, rank) -> microbatches
    # (gen, step, epoch, replica, rank) with a reduce ok -> the microbatches it reduced (None: a log
    # written before reduce records named them)
    reduced: dict[tuple[int, int, int, int, int], frozenset[int] | None] = {}
    applied: dict[tuple[int, int, int], set[str]] = defaultdict(set)  # (gen, step, rank) -> state digests
    copies: list[tuple[int, dict[str, Any]]] = []  # (gen, step record)
    restored: dict[int, int] = {}  # gen -> the step its trainers restored (none: it started from step 0)
    gen = 0
    for r in records:
        kind = r["event"]
        if kind == "restart":
            gen += 1
        elif kind == "compute":
            for rank in r.get("shards", [r.get("rank", 0)]):  # a shrunk group's rank computes every shard's
                computed[gen, r["step"], r["replica"], rank].add(r["microbatch"])
        elif kind == "reduce" and r.get("ok"):
            held = r.get("microbatches")
            reduced[gen, r["step"], r["epoch"], r["replica"], r.get("rank", 0)] = \
                None if held is None else frozenset(held)
        elif kind == "applied":
            applied[gen, r["step"], r.get("rank", 0)].add(r.get("state_digest") or r.get("param_digest"))
        elif kind == "step":
            copies.append((gen, r))
        elif kind == "restored":  # a trainer of this generation loaded the state after step r["step"]
            restored[gen] = min(restored.get(gen, r["step"]), r["step"])
    problems: list[str] = []
    seen: dict[tuple[int, int], int] = {}
    for g, r in copies:
        s = r.get("step")
        missing_fields = [f for f in ("step", "owners", "members", "epoch") if f not in r]
        if missing_fields:
            raise CorruptLog(f"the record of step {s} lacks {', '.join(missing_fields)}")
        seen[g, s] = seen.get((g, s), 0) + 1
        where = f"step {s}" + (f" (generation {g})" if g else "")
        problems += [f"{where}: {p}" for rank in ranks
                     for p in _check_copy(r, g, m, computed, reduced, applied, rank, len(ranks) > 1)]
    for (g, s), n in sorted(seen.items()):
        if n > 1:
            problems.append(f"step {s}: recorded {n} times in generation {g}")
    problems += _generations(sorted(seen), n_steps, restored)
    recorded = {s for _, s in seen}
    absent = [s for s in range(n_steps) if s not in recorded]
    if absent:
        problems.append(f"steps without a record: {_ranges(absent)} (of 0..{n_steps - 1})")
    extra = sorted(s for s in recorded if not 0 <= s < n_steps)
    if extra:
        problems.append(f"steps outside 0..{n_steps - 1}: {extra}")
    return problems


def _generations(copies: list[tuple[int, int]], n_steps: int, restored: dict[int, int]) -> list[str]:
    """Each generation's copies (`copies`: sorted (generation, step)) contiguous from its first step to its
    last; a later generation's first copy the step after the one its trainers restored (`restored`; none
    restored: step 0); the last generation reaching step N-1 (a generation that recorded nothing is left
    out: it committed nothing)."""
    steps: dict[int, list[int]] = defaultdict(list)
    for g, s in copies:
        steps[g].append(s)
    problems = []
    for g, ss in sorted(steps.items()):
        gaps = [s for s in range(ss[0], ss[-1] + 1) if s not in set(ss)]
        if gaps:
            problems.append(f"generation {g}: steps without a record between its first and last: {_ranges(gaps)}")
        expected = restored[g] + 1 if g in restored else 0
        if g > 0 and ss[0] != expected:
            problems.append(f"generation {g} restored the state after step {expected - 1} but its first step "
                            f"record is step {ss[0]}" if g in restored else
                            f"generation {g} restored nothing (it started over) but its first step record is step {ss[0]}")
    if steps:
        g, last = max(steps), steps[max(steps)][-1]
        if last < n_steps - 1:
            problems.append(f"the last generation ({g}) ends at step {last}, not {n_steps - 1}: steps "
                            f"{_ranges(list(range(last + 1, n_steps)))} of its run were never recorded")
    return problems


def _check_copy(r: dict[str, Any], g: int, m: int, computed, reduced, applied, rank: int = 0,
                named: bool = False) -> list[str]:
    s, epoch, members = r["step"], r["epoch"], sorted(r["members"])
    owners = {int(k): v for k, v in r["owners"].items()}
    problems = []
    who = f" rank {rank}" if named else ""  # groups of one rank: as before
    owned = [mb for mbs in owners.values() for mb in mbs]
    if rank == 0 and sorted(owned) != list(range(m)):
        dup = sorted({x for x in owned if owned.count(x) > 1})
        missing = sorted(set(range(m)) - set(owned))
        problems.append(f"microbatches duplicated {dup}, missing {missing}")
    if rank == 0 and sorted(owners) != members:
        problems.append(f"owners {sorted(owners)} are not the commit members {members}")
    for o, mbs in sorted(owners.items()):
        never = sorted(set(mbs) - computed.get((g, s, o, rank), set()))
        if never:
            problems.append(f"replica {o}{who} is credited with microbatches {never} it never computed")
        if (g, s, epoch, o, rank) not in reduced:
            problems.append(f"replica {o}{who} has no successful reduce in the commit epoch {epoch}")
        elif reduced[g, s, epoch, o, rank] not in (None, frozenset(mbs)):
            problems.append(f"replica {o}{who} reduced microbatches {sorted(reduced[g, s, epoch, o, rank])} in "
                            f"the commit epoch {epoch}, but is credited with {sorted(mbs)}")
    digests = applied.get((g, s, rank), set())
    if len(digests) != 1:
        problems.append(f"members{who} applied {len(digests)} different parameter digests")
    return problems


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7': a missing tail of thousands of steps stays one short line."""
    out, lo = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ", ".join(out)


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's config.json as a dict, old key names moved to their new ones (config.upgrade: a run
    written before [faults] and [launch] held its fault spec and run directory under [run]). Raises
    FileNotFoundError without one, ValueError if it is not a config."""
    text = (Path(run_dir) / "config.json").read_text()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{Path(run_dir) / 'config.json'} is not JSON ({e.msg})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("run"), dict):
        raise ValueError(f"{Path(run_dir) / 'config.json'} has no [run] section")
    try:
        return upgrade(cfg)
    except ConfigError as e:
        raise ValueError(f"{Path(run_dir) / 'config.json'}: {e}") from None
