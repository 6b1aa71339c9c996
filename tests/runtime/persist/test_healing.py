"""The heal group's forming (persist/healing.Forming): a donor whose joiner is gone gives up as soon as the
coordinator says so, not after the whole collective timeout (a real gloo group over a real TCPStore); and
the transfer in buckets: a joiner ends with the donor's parameters and optimizer state, bit for bit."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from unbroken.config.schema import ModelConfig
from unbroken.model.gpt import GPT
from unbroken.runtime.persist import healing
from unbroken.runtime.persist.healing import Forming, donate, receive

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


def test_a_heal_in_many_buckets_gives_the_joiner_the_donors_state_bit_for_bit(monkeypatch):
    monkeypatch.setattr(healing, "BUCKET_BYTES", 16 << 10)  # the 2 x 32 GPT's ~0.6 MB of state in ~40
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: TCPStore("127.0.0.1", server.port, is_master=False)  # noqa: E731
    states = []
    for seed in (0, 1):  # the donor's, trained a step; the joiner's, fresh
        torch.manual_seed(seed)
        model = GPT(ModelConfig(n_layer=2, n_embd=32, dropout=0.0))
        states.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    (donor_model, donor_opt), (joiner_model, joiner_opt) = states
    x = torch.randint(0, 256, (2, 16))
    donor_model(x, x).backward()
    donor_opt.step()
    assert len(healing._buckets(healing._whole(donor_model, donor_opt)[1])) > 10
    sent = []
    forming = (Forming(client(), "heal/1/2/0/0/", 0, 20.0), Forming(client(), "heal/1/2/0/0/", 1, 20.0))
    thread = threading.Thread(target=lambda: sent.append(donate(forming[0], donor_model, donor_opt)))
    thread.start()
    got = receive(forming[1], joiner_model, joiner_opt)  # raises HealMismatch on a digest that differs
    thread.join(20)
    assert sent and sent[0][0] == got[0]
    for a, b in zip(healing._whole(donor_model, donor_opt)[1], healing._whole(joiner_model, joiner_opt)[1]):
        assert torch.equal(a, b)
