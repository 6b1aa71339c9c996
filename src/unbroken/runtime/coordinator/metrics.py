"""Live figures of a running job, kept by the coordinator: Prometheus `/metrics`, TensorBoard event files,
Weights & Biases (trackers.py), and the status snapshot in the store that `unbroken status HOST:PORT` reads.

Owns: tailing RUN_DIR/events.jsonl into a `RunView` (the coordinator sees every process's records
there, as the launcher does), the Prometheus metric names and labels, what goes to TensorBoard, and the
`status/view` store key. Does not own: the figures' definitions (observe/view.py), verdicts or decisions
(the coordinator and members), rendering (observe/status.py).

Both exporters are optional extras (`pip install unbroken[metrics]`): `prometheus_client` is imported only
with `--metrics.port`, `torch.utils.tensorboard` (which needs `tensorboard`) only with `--metrics.tensorboard`,
`wandb` (`unbroken[wandb]`) only with `--metrics.wandb`.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError
from unbroken.runtime.store import keys
from unbroken.observe.view import RunView
from unbroken.runtime.coordinator.trackers import Figure, WandbRun, figures

# Records the view does not fold (most of the log): skipped unparsed, as the launcher's tail does.
_SKIP = tuple(f'{{"event":"{kind}"'.encode() for kind in ("compute", "reduce", "applied"))
HEALTH = ("healthy", "suspect", "slow", "dead")
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # s


def preflight(port: int, host: str, tensorboard: str, wandb: str = "") -> None:
    """Raise ConfigError (one line naming the option) when the metrics asked for cannot be served: an
    extra not installed, or `host:port` not bindable. Call before a run touches its directory; the
    coordinator binds the port for real moments later."""
    import importlib.util

    for option, value, module, extra in (("port", port, "prometheus_client", "metrics"),
                                         ("tensorboard", tensorboard, "tensorboard", "metrics"),
                                         ("wandb", wandb, "wandb", "wandb")):
        if value and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{option}={value}: needs {module} (pip install 'unbroken[{extra}]')")
    if port:
        check_port(host, port)


def check_port(host: str, port: int) -> None:
    """Raise ConfigError when `host:port` cannot be bound (in use, or no such local address)."""
    try:
        with socket.socket() as s:
            s.bind((host, port))
    except socket.gaierror:
        raise ConfigError(f"metrics.host={host!r}: not an address to listen on") from None
    except OSError as e:
        raise ConfigError(f"metrics.port={port}: cannot listen on {host}:{port} ({e.strerror or e})") from None


class Exporter:
    """Folds the run's event log and exports it. Call `poll()` from the coordinator's loop (it reads the
    log at most every `every` s) and `close()` once at the end. Scrapes run on prometheus_client's own
    thread and read the view under a lock."""

    def __init__(self, run_dir: str | Path, store, port: int = 0, host: str = "127.0.0.1", tensorboard: str = "",
                 checkpoint_dir: str = "", every: float = 0.5, wandb: str = ""):
        self.events, self.store, self.every = Path(run_dir) / "events.jsonl", store, every
        self.run_dir = str(Path(run_dir).resolve())
        self.view, self.lock, self.offset = RunView(history=False), threading.Lock(), 0
        self.ckpt_dir, self.next_read, self.next_ckpt = checkpoint_dir, 0.0, 0.0
        self.server = self.writer = None
        self.error: str | None = None
        if port:
            try:
                self.server = _serve(self, host, port)
            except OSError as e:  # taken since the launcher checked it: train on, say so
                self.error = f"metrics.port={port}: cannot listen on {host}:{port} ({e.strerror or e})"
                print(f"unbroken: {self.error}", file=sys.stderr, flush=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(tensorboard)
        self.wandb = WandbRun(wandb, run_dir) if wandb else None

    def poll(self, force: bool = False) -> None:
        """Read what the log gained, update the figures and the store's status snapshot. Never raises:
        watching a job must not end it (a failure is printed to the coordinator's log once)."""
        now = time.monotonic()
        if not force and now < self.next_read:
            return
        self.next_read = now + self.every
        try:
            self._poll(now, force)
        except Exception as e:  # noqa: BLE001  (a full disk under TensorBoard, a torn JSON we missed, ...)
            if self.error is None:
                self.error = f"metrics exporter: {type(e).__name__}: {e}"
                print(f"unbroken: {self.error}", file=sys.stderr, flush=True)

    def _poll(self, now: float, force: bool) -> None:
        try:
            with open(self.events, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        records = []
        for line in chunk[:end].splitlines():
            if line.strip() and not line.startswith(_SKIP):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by a killed writer
        with self.lock:
            shown = self.view.feed(records)
            if self.ckpt_dir and (force or now >= self.next_ckpt):
                self.next_ckpt = now + 2.0  # a directory listing: not every round
                self.view.checkpoint_step = latest_checkpoint_step(self.ckpt_dir, self.view.run_id)
            status = self.view.status(time.time())
        points = figures(shown, self.view) if self.writer is not None or self.wandb is not None else []
        if self.wandb is not None:
            self.wandb.log(points, self.view.run_id)
        if self.writer is not None:
            self._tensorboard(points)
        status["run_dir"] = self.run_dir
        status["metrics_error"] = self.error
        self.store.set(keys.status(), json.dumps(status))

    def _tensorboard(self, points: list[Figure]) -> None:
        """trackers.figures' points: scalars, and texts (recoveries, faults). Global step = training step."""
        for p in points:
            if isinstance(p.value, str):
                self.writer.add_text(p.tag, p.value, p.step, walltime=p.t)
            else:
                self.writer.add_scalar(p.tag, p.value, p.step, walltime=p.t)
        if points:
            self.writer.flush()

    def close(self) -> None:
        self.poll(force=True)
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.server is not None:
            self.server.shutdown()

    def families(self):
        """The Prometheus metric families of the view now (prometheus_client's collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self.lock:
            v, now = self.view, time.time()
            last = v.committed.get(v.frontier)
            yield GaugeMetricFamily("unbroken_committed_step", "Highest step with every step up to it committed "
                                    "(-1: none yet)", value=v.frontier)
            yield CounterMetricFamily("unbroken_committed_tokens", "Tokens of committed steps, each step once",
                                      value=v.tokens)
            yield GaugeMetricFamily("unbroken_tokens_per_second", "Committed tokens per second over the last 20 "
                                    "steps", value=v.tokens_per_second() or 0.0)
            yield GaugeMetricFamily("unbroken_loss", "Training loss of the latest committed step",
                                    value=last["loss"] if last else float("nan"))
            yield GaugeMetricFamily("unbroken_eval_loss", "Validation loss of the latest evaluated step's "
                                    "parameters (NaN: none yet; eval.every)",
                                    value=v.evals[max(v.evals)] if v.evals else float("nan"))
            yield GaugeMetricFamily("unbroken_learning_rate", "Learning rate of the latest committed step "
                                    "(group 0's)", value=_number(last, "lr"))
            yield GaugeMetricFamily("unbroken_grad_norm", "Global norm of the latest committed step's reduced "
                                    "gradient before clipping (NaN: no clipping)", value=_number(last, "grad_norm"))
            yield GaugeMetricFamily("unbroken_live_replica_groups", "Members of the current membership epoch",
                                    value=len(v.members))
            yield GaugeMetricFamily("unbroken_membership_epoch", "Current membership epoch", value=v.epoch)
            yield GaugeMetricFamily("unbroken_generation", "Whole-job restarts so far (store prefix gN/)",
                                    value=v.generation)
            yield _labelled(CounterMetricFamily, "unbroken_recoveries", "In-step recoveries and restarts "
                            "(one per interrupted step), by cause", "cause", _count(v.incidents, "cause"))
            yield _labelled(CounterMetricFamily, "unbroken_step_retries", "Retry decisions, by the cause of "
                            "the epoch change", "cause", v.retries)
            yield _labelled(CounterMetricFamily, "unbroken_restarts", "Whole-job restarts, by restore source",
                            "source", v.restarts)
            yield _labelled(CounterMetricFamily, "unbroken_faults_injected", "Injected faults, by kind", "kind",
                            _count(v.faults, "kind"))
            done = [i.seconds for i in v.incidents if i.seconds is not None]
            buckets = [(str(b), sum(d <= b for d in done)) for b in RECOVERY_BUCKETS] + [("+Inf", len(done))]
            yield HistogramMetricFamily("unbroken_recovery_seconds", "Seconds from a failure's first sign to "
                                        "the commit of the step it interrupted", buckets=buckets,
                                        sum_value=sum(done))
            yield GaugeMetricFamily("unbroken_recovery_in_progress", "Recoveries not yet committed",
                                    value=sum(i.end is None for i in v.incidents))
            yield CounterMetricFamily("unbroken_microbatches_redone", "Microbatches recomputed by survivors",
                                      value=sum(len(i.redo) for i in v.incidents))
            yield CounterMetricFamily("unbroken_steps_redone", "Step commits of a step committed before "
                                      "(work lost to a restart)", value=v.steps_redone)
            health = GaugeMetricFamily("unbroken_replica_health", "1 for the replica's current state "
                                       "(detector verdict, or dead)", labels=["replica", "state"])
            speed = GaugeMetricFamily("unbroken_replica_speed", "Detector's speed estimate (1: typical)",
                                      labels=["replica"])
            noise = GaugeMetricFamily("unbroken_replica_score_noise", "Detector's measured noise of the replica's "
                                      "step score (log-sd; its thresholds follow it)", labels=["replica"])
            for r, sd in sorted(v.noise.items()):
                noise.add_metric([str(r)], sd)
            share = GaugeMetricFamily("unbroken_replica_microbatch_share", "Share of the latest committed "
                                      "step's microbatches the replica reduced", labels=["replica"])
            for r in range(v.replicas):
                state = v.health.get(r, "healthy")
                for h in HEALTH:
                    health.add_metric([str(r), h], float(state == h))
                speed.add_metric([str(r)], v.speed.get(r, 1.0))
                if last:
                    share.add_metric([str(r)], len(last["owners"].get(str(r), ())) / last["microbatches"])
            yield from (health, speed, noise, share)
            yield _labelled(CounterMetricFamily, "unbroken_corruptions_found", "Times a device (replica[.rank]) "
                            "was found computing wrong values: state differing from the majority's, or a "
                            "non-finite gradient", "device", v.suspects)
            yield GaugeMetricFamily("unbroken_devices_evicted", "Devices evicted as corrupted", value=len(v.evicted))
            yield _labelled(CounterMetricFamily, "unbroken_detector_verdicts", "Fail-slow verdict changes, by "
                            "new state", "verdict", v.verdicts)
            snap = v.snapshot
            yield GaugeMetricFamily("unbroken_snapshot_step", "Step of the newest in-memory snapshot (-1: none)",
                                    value=snap["step"] if snap else -1)
            yield GaugeMetricFamily("unbroken_snapshot_age_seconds", "Seconds since the newest snapshot began",
                                    value=now - snap["t"] if snap else float("nan"))
            yield CounterMetricFamily("unbroken_snapshots_skipped", "Snapshots skipped (both slots busy)",
                                      value=v.snapshots_skipped)
            ck = v.checkpoint_step
            yield GaugeMetricFamily("unbroken_checkpoint_step", "Step of the newest complete DCP checkpoint "
                                    "(-1: none)", value=-1 if ck is None else ck)


def _labelled(cls, name: str, doc: str, label: str, values: dict[str, int]):
    fam = cls(name, doc, labels=[label])
    for key, n in sorted(values.items()):
        fam.add_metric([key], n)
    return fam


def _count(items, attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        key = str(it[attr] if isinstance(it, dict) else getattr(it, attr))
        out[key] = out.get(key, 0) + 1
    return out


def _serve(exporter: Exporter, host: str, port: int):
    from prometheus_client import CollectorRegistry, start_http_server

    class _Collector:
        def collect(self):
            return exporter.families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def latest_checkpoint_step(directory: str, run_id: str) -> int | None:
    """Step of the newest complete checkpoint of `run_id` in `directory`; None when there is none (yet)."""
    from unbroken.runtime.persist.checkpoint import CheckpointNotFound, ForeignCheckpoint, latest_checkpoint
    try:
        return latest_checkpoint(directory, run_id)
    except (CheckpointNotFound, ForeignCheckpoint):
        return None


def _number(record: dict | None, key: str) -> float:
    """A step record's figure for a gauge: NaN where the record or the figure is absent."""
    value = None if record is None else record.get(key)
    return float("nan") if value is None else float(value)
