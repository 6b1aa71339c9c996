"""The heal group's forming (persist/healing.Forming): a donor whose joiner is gone gives up as soon as the
coordinator says so, not after the whole collective timeout (a real gloo group over a real TCPStore)."""
from __future__ import annotations

import time

import pytest
from torch.distributed import TCPStore

from unbroken.runtime.persist.healing import Forming

pytestmark = pytest.mark.timeout(60)


def test_a_donor_gives_up_forming_once_the_joiner_is_known_gone():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    forming = Forming(store, "heal/1/2/0/0/", 0, timeout_s=30.0)  # the joiner (rank 1) never comes
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the other side is gone"):
        forming.get(gone=lambda: time.monotonic() - t0 > 0.5, poll_s=0.05)
    assert time.monotonic() - t0 < 3.0  # not the 30 s timeout


def test_without_a_gone_check_forming_waits_for_its_timeout_and_says_why():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    forming = Forming(store, "heal/1/2/0/0/", 0, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the heal group did not form"):
        forming.get()
    assert 0.9 < time.monotonic() - t0 < 10.0


def test_a_joiner_that_comes_forms_the_group_though_gone_is_asked():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # a client each, as Coordination.group_store gives: gloo's rendezvous blocks its client in `wait`
    client = lambda: TCPStore("127.0.0.1", server.port, is_master=False)  # noqa: E731
    asked = []
    donor = Forming(client(), "heal/1/2/0/0/", 0, timeout_s=20.0)
    joiner = Forming(client(), "heal/1/2/0/0/", 1, timeout_s=20.0)
    pg = donor.get(gone=lambda: bool(asked.append(1)), poll_s=0.01)  # asked, never gone
    assert pg.size() == 2 and joiner.get().size() == 2
