"""The test suite's time against an earlier commit's, side by side in one run: the tests both commits
hold, each side's own pytest on its own etcd cluster, at the same time on the same host.

    python benchmarks/suite_time.py --base b53df13 [--current HEAD] [--workers 1] [--turns K] [-- PYTEST_ARGS]

What it measures: each side runs the test IDs both trees collect (the current tree deselects the tests
the base lacks; the base deselects the ones the current tree lost), with `--workers` xdist workers each
(1: the two sides together load the host as CI's `-n 2` does). It prints each side's wall clock and the
sum of its tests' own times (setup, call and teardown, from pytest's JUnit XML) over the tests that passed
on both sides, the ratios current / base, and the files whose summed time moved most. A ratio above 1
says the current code runs the same tests slower. Both sides share the host's load (other work on it
included), so the ratio holds where the absolute seconds do not; a test that failed on either side is
left out of the sums and counted.

`--turns K` (K > 0): the sides take turns instead of running at once, so that neither test shares the
host with the other side's: the test files both trees hold are dealt into K slices, and each slice runs
on one side, then on the other (ABBA: the first slice base first, the second current first, ...), with
`--workers` each (2: as CI runs). Each test is then timed next to its counterpart, minutes apart, on a
host loaded only by its own side's workers; the wall clock is the sum of each side's slices.

PYTEST_ARGS go to both sides' collection and runs (e.g. `--ignore=tests/runtime/trainer/test_shrink.py` to leave
out files whose fault tests time out on a host loaded by other work; say so with the figure).

What it leaves out: the tests only the current tree holds (their time is the suite's growth, not its
speed), and the virtual environment: both sides run this interpreter's packages.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def collect(tree: Path, extra: list[str]) -> set[str]:
    """The test IDs pytest collects in `tree` (its own src first on the path), with `extra` arguments."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o",
                        "addopts=", "-n", "0", *extra], cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tree / "src")})
    ids = {line for line in r.stdout.splitlines() if "::" in line}
    if not ids:
        raise SystemExit(f"no tests collected in {tree}: {r.stdout[-500:]}{r.stderr[-500:]}")
    return ids


def node_id(case: ET.Element) -> str:
    """A JUnit testcase's pytest node ID (classname tests.runtime.test_x[.Class], name test_y[param])."""
    parts = case.get("classname", "").split(".")
    k = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "/".join(parts[:k + 1]) + ".py::" + "::".join(parts[k + 1:] + [case.get("name", "")])


def results(xml: Path) -> dict[str, tuple[float, bool]]:
    """node ID -> (seconds, passed) from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = any(c.tag in ("failure", "error") for c in case)
        skipped = any(c.tag == "skipped" for c in case)
        out[node_id(case)] = (float(case.get("time", 0.0)), not bad and not skipped)
    return out


def start_etcd(work: Path, name: str) -> str:
    """Start one side's etcd cluster (tests.etcd_cluster); returns its URL."""
    etcd_dir = work / f"{name}-etcd"
    etcd_dir.mkdir()
    return subprocess.run([sys.executable, "-m", "tests.etcd_cluster", "start", str(etcd_dir)], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()


def start_side(tree: Path, drop: set[str], workers: int, work: Path, name: str, extra: list[str], etcd: str,
               targets: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    """Start one side's pytest on `targets` (default: the whole suite) with the tests `drop` deselected;
    returns the process and its JUnit XML path (`name` names the log, XML and argument files)."""
    args_file = work / f"{name}.args"
    args_file.write_text("".join(f"--deselect\n{t}\n" for t in sorted(drop)))
    xml = work / f"{name}.xml"
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "UNBROKEN_TEST_ETCD": etcd, "CI": "true"}
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers),
                          f"--junitxml={xml}", *extra, *targets, f"@{args_file}"], cwd=tree, env=env,
                         start_new_session=True, stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    return p, xml


def reap(tree: Path) -> None:
    """Kill every process still working in `tree`: a run's launcher, fork servers and torchrun agents
    start sessions of their own, so killing pytest's process group leaves them running (Linux: /proc)."""
    for _ in range(3):  # a fork server may fork once more between two passes
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(tree):
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)


def stop_etcd(work: Path, name: str) -> None:
    subprocess.run([sys.executable, "-m", "tests.etcd_cluster", "stop", str(work / f"{name}-etcd")], cwd=ROOT,
                   capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--current", default="HEAD", help="the commit to time against it (default HEAD; both "
                    "run from worktrees of their own, so the checkout may change meanwhile)")
    ap.add_argument("--workers", type=int, default=1, help="xdist workers a side (default 1)")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for both sides' pytest")
    ap.add_argument("--keep", help="a folder to keep the logs and JUnit XML in (default: a temporary one)")
    ap.add_argument("--turns", type=int, default=0, help="K > 0: the sides take turns over K slices of the test "
                    "files (ABBA) instead of running at once")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` stops both sides too (the finally below)
    console = Console()
    work = Path(a.keep or tempfile.mkdtemp(prefix="suite-time-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {"base": work / "base-tree", "current": work / "current-tree"}
    for name, rev in (("base", a.base), ("current", a.current)):
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[name]), rev], cwd=ROOT, check=True)
    procs: dict[str, subprocess.Popen] = {}
    try:
        ids = {name: collect(tree, a.pytest_args) for name, tree in trees.items()}
        common = ids["base"] & ids["current"]
        console.print(f"base {a.base}: {len(ids['base'])} tests, current {a.current}: {len(ids['current'])}, "
                      f"both: {len(common)}")
        etcd = {name: start_etcd(work, name) for name in trees}
        if a.turns > 0:
            res, wall = take_turns(console, trees, ids, common, a, work, etcd, procs)
        else:
            res, wall = at_once(console, trees, ids, common, a, work, etcd, procs)
        console.print()
        report(console, res, wall, common)
    finally:
        for name, tree in trees.items():
            if name in procs and procs[name].poll() is None:
                os.killpg(procs[name].pid, signal.SIGKILL)
            reap(tree)
            stop_etcd(work, name)
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def at_once(console: Console, trees: dict[str, Path], ids: dict[str, set[str]], common: set[str],
            a: argparse.Namespace, work: Path, etcd: dict[str, str], procs: dict[str, subprocess.Popen]):
    """Both sides' whole runs at the same time; returns each side's results and wall seconds."""
    xml, started, ended = {}, time.monotonic(), {}
    for name, tree in trees.items():
        procs[name], xml[name] = start_side(tree, ids[name] - common, a.workers, work, name, a.pytest_args,
                                            etcd[name])
    with Live(console=console, refresh_per_second=1) as live:
        while len(ended) < 2:
            for name, p in procs.items():
                if name not in ended and p.poll() is not None:
                    ended[name] = time.monotonic() - started
            t = Table.grid(padding=(0, 2))
            for name in procs:
                t.add_row(name, f"{ended.get(name, time.monotonic() - started):7.0f} s",
                          "done" if name in ended else "running")
            live.update(t)
            time.sleep(1)
    return {n: results(x) for n, x in xml.items()}, ended


def take_turns(console: Console, trees: dict[str, Path], ids: dict[str, set[str]], common: set[str],
               a: argparse.Namespace, work: Path, etcd: dict[str, str], procs: dict[str, subprocess.Popen]):
    """The common test files in `a.turns` slices, each run on one side and then the other (ABBA); returns
    each side's results (merged over the slices) and summed wall seconds."""
    files = sorted({t.split("::")[0] for t in common})
    slices = [files[k::a.turns] for k in range(a.turns) if files[k::a.turns]]
    options = [x for x in a.pytest_args if x.startswith("-")]  # paths among them: the slices replace them
    res: dict[str, dict] = {"base": {}, "current": {}}
    wall = {"base": 0.0, "current": 0.0}
    with Progress(console=console) as progress:
        task = progress.add_task("slices, both sides", total=2 * len(slices))
        for k, chunk in enumerate(slices):
            for name in (("base", "current") if k % 2 == 0 else ("current", "base")):
                progress.update(task, description=f"slice {k + 1}/{len(slices)}: {name}")
                mine = {t for t in ids[name] if t.split("::")[0] in chunk}
                started = time.monotonic()
                procs[name], xml = start_side(trees[name], mine - common, a.workers, work, f"{name}-{k}",
                                              options, etcd[name], chunk)
                procs[name].wait()
                wall[name] += time.monotonic() - started
                reap(trees[name])  # nothing of this slice runs into the other side's turn
                if xml.exists():
                    res[name].update(results(xml))
                progress.advance(task)
    return res, wall


def report(console: Console, res: dict[str, dict[str, tuple[float, bool]]], wall: dict[str, float],
           common: set[str]) -> None:
    """Print each side's wall clock and summed test time over the tests that passed on both, the ratios,
    and the files whose time moved most."""
    ok = {t for t in common if all(res[n].get(t, (0.0, False))[1] for n in res)}
    failed = {n: sorted(t for t in common if t in res[n] and not res[n][t][1]) for n in res}
    total = {n: sum(res[n][t][0] for t in ok) for n in res}
    for n in ("base", "current"):
        console.print(f"{n}: wall {wall[n]:.0f} s; {len(ok)} tests passed on both sides: {total[n]:.0f} s of test "
                      f"time; not passed here: {len(failed[n])} {failed[n][:5]}")
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for t in ok:
        f = t.split("::")[0]
        by_file[f][0] += res["base"][t][0]
        by_file[f][1] += res["current"][t][0]
    moved = sorted(by_file.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:8]
    for f, (b, c) in moved:
        console.print(f"  {f}: {b:.1f} s -> {c:.1f} s")
    print(f"ratio suite_wall {wall['current'] / wall['base']:.3f}")
    print(f"ratio suite_test_time {total['current'] / max(total['base'], 1e-9):.3f}")


if __name__ == "__main__":
    sys.exit(main())
