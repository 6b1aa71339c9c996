"""The detector's clock: device time grows with work done and injected spin, not with waiting; wall time
grows with both. In-process, real clocks (thread CPU time on CPU, CUDA events on a GPU)."""
from __future__ import annotations

import time

import pytest
import torch

from unbroken.events import EventLog
from unbroken.faultspec import parse
from unbroken.runtime.devicetime import DeviceClock
from unbroken.runtime.faults import Injector


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
    # not slowed at this step: nothing added
    inj = Injector(parse("slow:replica=0,from=2,factor=3,how=spin", 1, 5), 0, log)
    span = clock.start()
    busy(0.03)
    inj.stretch(0, span)
    assert span.stop()[0] < 0.05


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
