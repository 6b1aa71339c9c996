"""How often each test passes, fails and skips when the suite (or a part of it) runs N times.

Owns: repeating pytest over the chosen tests, each repetition a fresh process tree (a new pytest, its own
xdist workers, CLI fork servers and runs) in a fresh clone of the committed tree (`--clone`, as CI runs
it) or in this checkout; reading each repetition's JUnit XML; and the table: per test, its passes,
failures, skips (with the first skip's reason: a premise the host broke), and its slowest run. Does not
own: retrying (nothing is retried: a failure counts as one) or the tests themselves.

    python benchmarks/flakiness.py --repeat 5                        # the whole suite, 5 times
    python benchmarks/flakiness.py --repeat 20 -- tests/runtime/trainer/test_shrink.py -k "grows_back"

Prints one line per repetition as it ends, then the table of every test that did not pass every time
(or `--all`), sorted by failures, and `flaky tests: K of T` (tests with any failure or skip over those
run). What it leaves out: a test's variance within a repetition (each runs once a repetition).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(where: Path, args: list[str], xml: Path, timeout: float) -> tuple[int, float]:
    """pytest over `args` in `where`, its JUnit XML to `xml`: (exit code, wall seconds)."""
    env = {**os.environ, "PYTHONPATH": str(where / "src")}
    start = time.monotonic()
    try:
        code = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                              cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = -1
    return code, time.monotonic() - start


def outcomes(xml: Path) -> dict[str, tuple[str, float, str]]:
    """test id -> (passed | failed | skipped, seconds, the skip's or failure's first line)."""
    out = {}
    if not xml.exists():
        return out
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kind, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                kind, why = "failed", (child.get("message") or "").splitlines()[0][:120] if child.get("message") else ""
            elif child.tag == "skipped":
                kind, why = "skipped", (child.get("message") or "")[:120]
        out[name] = (kind, float(case.get("time") or 0.0), why)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clone", action="store_true", help="each repetition in a fresh git clone of HEAD")
    ap.add_argument("--all", action="store_true", help="list every test, not only those that did not always pass")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a repetition may take")
    ap.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the suite)")
    args = ap.parse_args()
    tally: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    slowest: dict[str, float] = defaultdict(float)
    reasons: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="flaky-") as tmp:
        for k in range(args.repeat):
            where = ROOT
            if args.clone:
                where = Path(tmp) / f"clone{k}"
                subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
            xml = Path(tmp) / f"run{k}.xml"
            code, seconds = one_run(where, args.pytest_args, xml, args.timeout)
            seen = outcomes(xml)
            for test, (kind, t, why) in seen.items():
                tally[test][kind] += 1
                slowest[test] = max(slowest[test], t)
                if why and kind != "passed":
                    reasons.setdefault(test, f"{kind}: {why}")
            counts = {kind: sum(1 for v in seen.values() if v[0] == kind) for kind in ("passed", "failed", "skipped")}
            print(f"repetition {k + 1}/{args.repeat}: exit {code}, {seconds:.0f} s, {counts}", flush=True)
    shown = [t for t in tally if args.all or tally[t]["failed"] or tally[t]["skipped"]]
    shown.sort(key=lambda t: (-tally[t]["failed"], -tally[t]["skipped"], t))
    print("\n| test | passed | failed | skipped | slowest s | first failure or skip |\n|---|---|---|---|---|---|")
    for t in shown:
        c = tally[t]
        print(f"| `{t}` | {c['passed']} | {c['failed']} | {c['skipped']} | {slowest[t]:.1f} | {reasons.get(t, '')} |")
    flaky = sum(1 for t in tally if tally[t]["failed"] or tally[t]["skipped"])
    print(f"\nflaky tests: {flaky} of {len(tally)} (any failure or skip in {args.repeat} repetitions)")


if __name__ == "__main__":
    main()
