"""Live progress of a run in the terminal (rich): a step bar, and one line per fault, death, recovery.

Owns: rendering event records as they arrive. Does not own: reading processes or files (the launcher
feeds it records). Disabled (a no-op) when `enabled` is False, e.g. in tests or with --launch.progress=false.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_SHOWN = {"fault", "member_dead", "recovery", "fenced", "run_failed", "worker_error", "verdict"}


class LiveView:
    def __init__(self, steps: int, title: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                                 transient=False)
        self.task = self.progress.add_task(title, total=steps, info="starting replicas")
        self.progress.start()

    def feed(self, records: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        for r in records:
            kind = r.get("event")
            if kind == "step":
                info = f"loss {r['loss']:.4f}  replicas {r['replicas']}  epoch {r['epoch']}"
                self.progress.update(self.task, completed=r["step"] + 1, info=info)
            elif kind == "verdict" and "slow" not in (r["old"], r["new"]):
                continue  # Suspect comes and goes with noise; only Slow moves work
            elif kind in _SHOWN:
                detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("event", "t", "who", "pid"))
                self.progress.console.print(f"[yellow]{kind}[/] {detail}")

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
