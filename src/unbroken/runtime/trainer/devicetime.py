"""Per-microbatch device time: the clock the fail-slow detector reads.

Owns: timing one span of compute (a microbatch's forward, backward and accumulation) the way the device
spends it, beside its wall time. On a GPU that is CUDA events around the span: the time the device was
busy with it, blind to the host waiting for a core. On a CPU the analogue is CPU time of the threads that
compute: a replica that waits for a core (4 replicas on 2 cores, a CPU-bound data loader beside it, a
noisy neighbour) does not accumulate it, a throttled core does (it needs more of it for the same work).
  threads == 1 (the default, and what exact mode pins on every replica): the calling thread's CPU time,
                `time.thread_time()` (CLOCK_THREAD_CPUTIME_ID); torch runs every kernel in that thread.
  threads > 1:  the process's CPU time, `time.process_time()`: the sum over torch's intra-op threads, plus
                the little the heartbeat and sidecar threads spend meanwhile (they block on sockets).
CUDA events time the stream from the span's first to its last event: gaps where the device idles
waiting for the host to launch its next kernel count too (on a device-bound microbatch there are none).
Not yet run on a GPU here (no device in this environment); tests/runtime/trainer/test_devicetime.py has the check.
Does not own: injecting slowness (faults.py burns CPU through `Span.burn`, so that it shows here as a
throttled core's would) or deciding anything from the times (policy/detection.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Span:
    """One timed span; `stop()` once, after the span's work (and any injected slowness)."""

    def __init__(self, cpu: Callable[[], float], device: torch.device):
        self.cpu, self.device = cpu, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        self.wall0 = time.perf_counter()
        self.cpu0 = cpu()

    def so_far(self) -> float:
        """Device seconds spent in the span until now (on CUDA: waits for the device to catch up)."""
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3  # ms -> s
        return self.cpu() - self.cpu0

    def burn(self, seconds: float) -> None:
        """Spend `seconds` more of the span's clock in busy work, as a throttled device would: on a CPU a
        spin of this thread until its CPU time has grown by `seconds` (waiting for a core meanwhile does
        not count, so under contention it takes longer in wall time, as a slow core's work does); on a
        GPU a device-side spin of about that long (`torch.cuda._sleep`, calibrated once)."""
        if seconds <= 0:
            return
        if self.cuda:
            torch.cuda._sleep(int(seconds * _cycles_per_second(self.device)))
            return
        end = self.cpu() + seconds
        while self.cpu() < end:
            pass

    def stop(self) -> tuple[float, float]:
        """(device seconds, wall seconds) of the span, each > 0."""
        device = self.so_far()
        return max(device, 1e-9), max(time.perf_counter() - self.wall0, 1e-9)


class DeviceClock:
    """Calling contract: build once per replica after `torch.set_num_threads`; `start()` per microbatch."""

    def __init__(self, device: torch.device, threads: int):
        self.device = device
        self.cpu = time.thread_time if threads == 1 else time.process_time

    def start(self) -> Span:
        return Span(self.cpu, self.device)


_CYCLES: dict[int, float] = {}


def _cycles_per_second(device: torch.device) -> float:
    """GPU spin cycles per second, measured once per device with CUDA events (clock rates vary by part)."""
    key = device.index or 0
    if key not in _CYCLES:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _CYCLES[key] = 10_000_000 / (a.elapsed_time(b) / 1e3)
    return _CYCLES[key]
