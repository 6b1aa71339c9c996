"""docs/cluster.md's lines run on hosts made of namespaces (hosts.py): the coordinator on host 0 bound to
its host's address (`--host`), the torchrun (or forkrun) job of group g on host g+1, naming the coordinator
by that address. Owns starting them, waiting on the run's events, and ending every process it started.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.hosts import Cluster, wait_for
from tests.docblocks import marked_lines

BIN = Path(sys.executable).parent
SRC = Path(__file__).resolve().parents[2] / "src"


def doc_lines(block: str = "cluster-commands") -> list[str]:
    return marked_lines("docs/cluster.md", block)


def env() -> dict[str, str]:
    """The environment of each host's processes: this venv's commands first, the package importable."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{path}" if path else str(SRC)}


def events(out: Path) -> list[dict]:
    """The run's events so far (a torn last line, being written, skipped)."""
    found = []
    path = out / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


@dataclass
class Run:
    cluster: Cluster
    out: Path
    coordinator: subprocess.Popen
    groups: list[subprocess.Popen] = field(default_factory=list)
    logs: Path = Path()
    injector: object = None  # chaos.Injector of the run's host and network faults, if any

    def events(self) -> list[dict]:
        return events(self.out)

    def until(self, predicate, timeout: float) -> list[dict]:
        """Wait until `predicate(events)` holds; the events then. Fails the test (with the logs) past
        `timeout` s."""
        seen: list[dict] = []

        def check() -> bool:
            seen[:] = self.events()
            return bool(predicate(seen))

        assert wait_for(check, timeout, every=0.05), self.tail()
        return seen

    def committed(self, step: int):
        return lambda evs: any(e["event"] == "step" and e["step"] >= step for e in evs)

    def wait(self, timeout: float) -> int:
        """The coordinator's exit code once it ends (it ends with the run); its groups' then."""
        try:
            self.coordinator.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end in {timeout} s\n{self.tail()}") from None
        for g in self.groups:
            try:
                g.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.injector is not None:
            self.injector.stop()
        return self.coordinator.returncode

    def tail(self, n: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}"
                         for p in sorted(self.logs.glob("*.log")))


def start(cluster: Cluster, tmp: Path, coordinator_flags: list[str] = (), restarts: int = 0,
          group_env: dict[str, str] | None = None, faults: str = "", groups: int = 2) -> Run:
    """docs/cluster.md's lines as written, but for the address (host 0's instead of 127.0.0.1), the run
    directory (under `tmp`, which every host shares), `--max-restarts=restarts`, and `coordinator_flags`
    after the documented ones. Group g runs on host g+1, with `group_env` added to its environment.
    `faults`: host and network faults (faultspec.NETWORK_KINDS), injected by the harness (chaos.py).
    `groups` beyond the documented two run group 1's forkrun line with their own `--group`."""
    h0 = cluster.hosts[0]
    lines = [line.replace("127.0.0.1", h0.address).replace("runs/cluster", str(tmp / "run"))
             .replace("--max-restarts=0", f"--max-restarts={restarts}").split() for line in doc_lines()]
    for g in range(2, groups):
        lines.append(lines[2][:-1] + [str(g)])
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    coordinator = h0.popen(lines[0] + list(coordinator_flags), logs / "coordinator.log", env=env(), cwd=tmp)
    run = Run(cluster, tmp / "run", coordinator, logs=logs)
    # the coordinator serves before it writes config.json (its first line says where)
    assert wait_for(lambda: (logs / "coordinator.log").read_text().startswith("unbroken coordinator: serving")
                    or coordinator.poll() is not None, 60), run.tail()
    first = (logs / "coordinator.log").read_text().splitlines()[0]
    assert first.startswith(f"unbroken coordinator: serving {h0.address}:29400"), first
    if faults:
        from tests.cluster.chaos import Injector, network_faults
        run.injector = Injector(cluster, run.out, network_faults(faults, len(lines) - 1, 10**6))
        run.injector.start()
    for g, line in enumerate(lines[1:]):
        run.groups.append(cluster.hosts[g + 1].popen(line, logs / f"group{g}.log", env={**env(), **(group_env or {})},
                                                     cwd=tmp))
    return run


def digests(evs: list[dict]) -> dict[int, str]:
    return {e["step"]: e["param_digest"] for e in evs if e["event"] == "step"}


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)
