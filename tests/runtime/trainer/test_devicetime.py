"""The detector's clock: device time grows with work done and injected spin, not with waiting; wall time
grows with both. In-process, real clocks (thread CPU time on CPU, CUDA events on a GPU)."""
from __future__ import annotations

import time

import pytest
import torch

from unbroken.events import EventLog
from unbroken.faultspec import parse
from unbroken.runtime.trainer.devicetime import DeviceClock
from unbroken.runtime.trainer.faults import Injector


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_waiting_shows_in_wall_time_only():
    span = DeviceClock(torch.device("cpu"), threads=1).start()
    busy(0.02)
    time.sleep(0.1)  # a replica waiting for a core (or for anything) accumulates no device time
    device, wall = span.stop()
    assert 0.02 <= device < 0.06
    assert wall >= 0.12


def test_burn_adds_device_time_as_a_throttled_core_would():
    span = DeviceClock(torch.device("cpu"), threads=1).start()
    busy(0.03)
    span.burn(0.06)
    device, wall = span.stop()
    assert 0.09 <= device < 0.14 and wall >= device


def test_spin_is_seen_on_the_device_clock_sleep_only_on_the_wall_clock(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", who="test")
    clock = DeviceClock(torch.device("cpu"), threads=1)
    measured = {}
    for how in ("spin", "sleep"):
        inj = Injector(parse(f"slow:replica=0,from=0,factor=3,how={how}", 1, 5), 0, log)
        span = clock.start()
        busy(0.03)
        inj.stretch(0, span)
        measured[how] = span.stop()
    spin_dev, spin_wall = measured["spin"]
    sleep_dev, sleep_wall = measured["sleep"]
    assert 0.085 <= spin_dev < 0.13  # 3x the 0.03 s of work, in CPU time
    assert 0.03 <= sleep_dev < 0.05  # the work alone
    assert sleep_wall >= 0.085  # ... though it took 3x as long
    # a sleep is capped (the worker's cap: a quarter of the progress timeout): 0.05 s, not 2 x 0.3 s
    inj = Injector(parse("slow:replica=0,from=0,factor=3,how=sleep", 1, 5), 0, log, sleep_cap_s=0.05)
    span = clock.start()
    time.sleep(0.3)  # a span a loaded host stretched
    inj.stretch(0, span)
    assert 0.34 <= span.stop()[1] < 0.5
    # for=: a fixed sleep, whatever the span took (0.2 s after a 0.01 s span, both well under 3x it)
    inj = Injector(parse("slow:replica=0,from=0,for=0.2", 1, 5), 0, log)
    span = clock.start()
    time.sleep(0.01)
    inj.stretch(0, span)
    assert 0.2 <= span.stop()[1] < 0.35
    # not slowed at this step: nothing added
    inj = Injector(parse("slow:replica=0,from=2,factor=3,how=spin", 1, 5), 0, log)
    span = clock.start()
    busy(0.03)
    inj.stretch(0, span)
    assert span.stop()[0] < 0.05


def test_spin_stretches_to_factor_times_the_unslowed_spans_not_the_slowed_compute(tmp_path):
    """A slowed span whose own compute ran slower than the replica's unslowed ones of the same work (on a
    CPU the spin evicts the caches the next microbatch refills) ends at F x the unslowed time: 3 x
    0.02 s, not 3 x its own 0.035 s (the old rule's 0.105 s); work of a shape never seen unslowed is
    stretched to F x its own time."""
    log = EventLog(tmp_path / "events.jsonl", who="test")
    clock = DeviceClock(torch.device("cpu"), threads=1)
    inj = Injector(parse("slow:replica=0,from=3,factor=3,how=throttle", 1, 5), 0, log)
    for step in range(3):  # unslowed: 0.02 s for 100 tokens each
        span = clock.start()
        busy(0.02)
        inj.stretch(step, span, 100, 800)
        assert span.stop()[0] < 0.03
    span = clock.start()
    busy(0.035)  # this microbatch's own compute, slower than the unslowed ones
    inj.stretch(3, span, 100, 800)
    assert 0.058 <= span.stop()[0] < 0.08
    span = clock.start()
    busy(0.01)  # a shape never seen unslowed: 3x its own time
    inj.stretch(4, span, 50, 400)
    assert 0.029 <= span.stop()[0] < 0.045


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_the_device_and_burn_spins_it():
    clock = DeviceClock(torch.device("cuda"), threads=1)
    a = torch.randn(2048, 2048, device="cuda")
    span = clock.start()
    for _ in range(10):
        a = a @ a / 2048
    span.burn(0.05)
    device, wall = span.stop()
    assert 0.05 <= device <= wall + 1e-3
