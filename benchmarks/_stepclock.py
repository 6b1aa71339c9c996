"""Thread-time clocks around a trainer's step functions, installed into each worker by benchmarks/step_cpu.py.

Owns: wrapping named functions of the trainer, its coordination, sidecar, accumulator, event log and
policy, and the model's own work (the outermost `nn.Module.__call__`, `Tensor.backward`, the optimizer's
`step` and `zero_grad`), each call adding its `time.thread_time()` (the calling thread's CPU, inclusive of
what it calls) and a count; writing the totals of this process to `DIR/clock-<pid>.json` every second.
Does not own: starting the run or reading the totals (step_cpu.py). Not part of unbroken: a run without
this module on its path has no clock in it.

How it gets in: step_cpu.py puts a `sitecustomize.py` that calls `install(DIR)` first on the workers'
PYTHONPATH; every process of the run imports it, and `install` does nothing outside a trainer worker.
"""
from __future__ import annotations

import json
import os
import threading
import time

TOTALS: dict[str, list[float]] = {}  # label -> [thread seconds, calls]
_DEPTH = threading.local()  # nested Module.__call__: only the outermost one is the model's work
# What a plain FSDP2 loop does a step too (benchmarks/_hsdp_baseline.py): the "plain." labels
PLAIN = {"part": "plain.part", "seed_microbatch": "plain.seed_microbatch", "loss_weight": "plain.loss_weight"}


def _clocked(label: str, f, outermost: bool = False):
    def clocked(*args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        if outermost and depth:
            return f(*args, **kwargs)
        _DEPTH.n = depth + 1 if outermost else depth
        t = time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            total = TOTALS.setdefault(label, [0.0, 0])
            total[0] += time.thread_time() - t
            total[1] += 1
            _DEPTH.n = depth
    return clocked


def _wrap(owner, names: list[str], prefix: str) -> None:
    for name in names:
        setattr(owner, name, _clocked(f"{prefix}.{name}", getattr(owner, name)))


def install(out_dir: str) -> None:
    """Call once at start-up (sitecustomize). In a trainer worker: wrap, and write totals every second."""
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    worker = any(a.startswith(b"unbroken.runtime.trainer") for a in argv)  # -m unbroken.runtime.trainer[.lifecycle]
    if not worker or b"torch.distributed.run" in argv:  # a worker, not its agent
        return
    import torch
    import torch.distributed.fsdp as fsdp
    import torch.nn as nn

    from unbroken import events
    from unbroken.model import data
    from unbroken.runtime.parallel import accumulator as gradients
    from unbroken.runtime.trainer import devicetime, faults, step as trainer
    from unbroken.runtime.trainer import heartbeat, sidecar
    from unbroken.runtime.trainer import membership as coordination
    from unbroken.runtime.parallel import collectives

    nn.Module.__call__ = _clocked("model.forward", nn.Module.__call__, outermost=True)
    _wrap(torch.Tensor, ["backward"], "model")
    _wrap(torch.optim.Optimizer, ["zero_grad"], "optimizer")
    _wrap(torch.optim.AdamW, ["step"], "optimizer")
    _wrap(trainer.Trainer, ["train_step", "compute", "reduce", "apply", "step_optimizer", "await_outcome",
                            "ahead"], "Trainer")
    _wrap(coordination.Coordination, ["stage", "publish", "propose", "wait_for", "proposal", "moved"], "Coordination")
    _wrap(sidecar.Sidecar, ["record", "wait_records"], "Sidecar")
    _wrap(gradients.Accumulator, ["add", "zero", "load_grads"], "Accumulator")
    _wrap(collectives.EpochGroup, ["allreduce"], "EpochGroup")
    _wrap(events.EventLog, ["emit"], "EventLog")
    _wrap(heartbeat.Heartbeat, ["at"], "Heartbeat")
    _wrap(trainer.rec, ["start", "on_event", "adopt"], "policy.recovery")  # as trainer/step.py calls them
    _wrap(devicetime.DeviceClock, ["start"], "DeviceClock")
    _wrap(devicetime.Span, ["stop"], "DeviceClock.Span")
    _wrap(faults.Injector, ["at", "stretch"], "Injector")
    for name in ["param_digest", *PLAIN]:  # functions trainer/step.py imported by name: clocked where it calls them
        setattr(trainer, name, _clocked(PLAIN.get(name, name), getattr(trainer, name)))
    _wrap(data.DataSource, ["microbatch"], "plain.data")
    _wrap(fsdp.FSDPModule, ["set_requires_gradient_sync"], "plain.fsdp")

    path = os.path.join(out_dir, f"clock-{os.getpid()}.json")

    def write() -> None:
        while True:
            time.sleep(1.0)
            with open(path + ".tmp", "w") as f:
                json.dump({"rank": os.environ.get("RANK"), "totals": TOTALS}, f)
            os.replace(path + ".tmp", path)

    threading.Thread(target=write, name="stepclock", daemon=True).start()
