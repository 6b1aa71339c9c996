"""The NCCL cross-group reduction's decisions (runtime/parallel/ncclmachine.py, nccl.py) against a fake
backend on the CPU, the choice of gloo or NCCL (crossgroup.py), the per-rank NCCL host identity
(device.py), and the device a real run's ranks record.

The fake is scripted by poll counts, so every race has one order by construction: what it says at the
n-th `formed()` or `completed()` is fixed by the test, never by a thread's timing.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import unbroken
from unbroken.config import ConfigError
from unbroken.events import read_events
from unbroken.runtime.parallel.collectives import CollectiveError, EpochGroup, EpochMoved
from unbroken.runtime.parallel.crossgroup import check, choose, describe, epoch_group
from unbroken.runtime.parallel.device import hostid_per_rank, shares_gpus
from unbroken.runtime.parallel.nccl import NcclEpochGroup
from unbroken.runtime.parallel.ncclmachine import Phase, ReductionMachine

pytestmark = pytest.mark.timeout(240)


class Fake:
    """A communicator that forms at the `form_at`-th `formed()` (None: never), and whose each issued
    reduction completes at its `done_at`-th `completed()` (None: never), failing with `error`. An issued
    reduction "sums" by doubling the copy, as two equal members would."""

    def __init__(self, form_at: int | None = 1, done_at: int | None = 1, error: str | None = None,
                 formation_error: str | None = None):
        self.form_at, self.done_at, self.err, self.ferr = form_at, done_at, error, formation_error
        self.form_polls = self.done_polls = 0
        self.issued: list[torch.Tensor] = []
        self.aborted = 0

    def formed(self) -> bool:
        self.form_polls += 1
        return self.form_at is not None and self.form_polls >= self.form_at

    def formation_error(self) -> str | None:
        return self.ferr

    def issue(self, copy) -> None:
        self.issued.append(copy)
        self.done_polls = 0

    def completed(self) -> bool:
        self.done_polls += 1
        done = self.done_at is not None and self.done_polls >= self.done_at
        if done and self.err is None and isinstance(self.issued[-1], torch.Tensor):
            self.issued[-1].mul_(2)
        return done

    def error(self) -> str | None:
        return self.err

    def abort(self) -> None:
        self.aborted += 1


def machine(fake: Fake, timeout_s: float = 10.0) -> ReductionMachine:
    return ReductionMachine(fake, timeout_s, now=0.0, abort_with=lambda abort: abort())


def test_forms_then_reduces_again_and_again_while_the_epoch_holds():
    fake = Fake(form_at=3, done_at=2)
    m = machine(fake)
    assert [m.formation(False, t) for t in (0.1, 0.2, 0.3)] == [Phase.FORMING, Phase.FORMING, Phase.READY]
    for _ in range(2):
        m.issue("copy", 1.0)
        assert [m.poll(False, 1.1), m.poll(False, 1.2)] == [Phase.REDUCING, Phase.DONE]
    assert fake.aborted == 0 and m.failure is None


def test_a_peer_lost_mid_reduction_aborts_once_and_the_group_is_spent():
    fake = Fake(done_at=2, error="NCCL communicator was aborted: remote process exited")
    m = machine(fake)
    assert m.formation(False, 0.0) is Phase.READY
    m.issue("copy", 1.0)
    assert m.poll(False, 1.1) is Phase.REDUCING
    assert m.poll(False, 1.2) is Phase.ABORTED
    assert not m.failure.moved and "remote process exited" in m.failure.reason and fake.aborted == 1
    assert m.poll(True, 99.0) is Phase.ABORTED and fake.aborted == 1  # terminal, aborted once
    with pytest.raises(ValueError):
        m.issue("copy", 2.0)


def test_an_epoch_change_during_formation_abandons_it_and_aborts_the_half_formed_communicator():
    fake = Fake(form_at=None)
    m = machine(fake)
    assert m.formation(False, 0.1) is Phase.FORMING
    assert m.formation(True, 0.2) is Phase.ABORTED
    assert m.failure.moved and fake.aborted == 1 and fake.issued == []


def test_an_abort_racing_a_completion_has_exactly_one_outcome():
    # the work completes at the very poll where the epoch moved and the timeout passed: completion is
    # read first, so the reduction is DONE and nothing is aborted
    fake = Fake(done_at=1)
    m = machine(fake, timeout_s=1.0)
    m.formation(False, 0.0)
    m.issue("copy", 0.0)
    assert m.poll(True, 5.0) is Phase.DONE and fake.aborted == 0
    # the epoch moves one poll before the work would complete: ABORTED, and the completion that follows
    # (the collective finishing while NCCL tears down) is never read, so its result is never used
    fake = Fake(done_at=3)
    m = machine(fake)
    m.formation(False, 0.0)
    m.issue("copy", 0.0)
    assert m.poll(False, 0.1) is Phase.REDUCING
    assert m.poll(True, 0.2) is Phase.ABORTED and m.failure.moved and fake.aborted == 1
    polls = fake.done_polls
    assert m.poll(False, 0.3) is Phase.ABORTED and fake.done_polls == polls


def test_timeouts_abort_formation_and_reduction():
    fake = Fake(form_at=None)
    m = machine(fake, timeout_s=2.0)
    assert m.formation(False, 1.0) is Phase.FORMING
    assert m.formation(False, 2.5) is Phase.ABORTED and not m.failure.moved and "did not form" in m.failure.reason
    fake = Fake(done_at=None)
    m = machine(fake, timeout_s=2.0)
    m.formation(False, 0.0)
    m.issue("copy", 10.0)
    assert m.poll(False, 11.9) is Phase.REDUCING
    assert m.poll(False, 12.1) is Phase.ABORTED and "timed out" in m.failure.reason and fake.aborted == 1


def test_a_formation_error_is_a_collective_error():
    m = machine(Fake(formation_error="ncclSystemError"))
    assert m.formation(False, 0.0) is Phase.ABORTED and not m.failure.moved and "ncclSystemError" in m.failure.reason


def group(fake: Fake, timeout_s: float = 10.0) -> NcclEpochGroup:
    return NcclEpochGroup(dist.HashStore(), 3, (0, 2), 2, timeout_s, backend=lambda store, rank, size: fake,
                          abort_with=lambda abort: abort())


def test_the_group_reduces_a_copy_and_leaves_the_buffer_as_it_was():
    buffer = torch.arange(4, dtype=torch.float64)
    g = group(Fake(form_at=2, done_at=3))
    into = torch.empty_like(buffer)
    calls = []
    result = g.allreduce(buffer, lambda: False, watch_every_s=0.001, on_issued=lambda: calls.append(1), into=into)
    assert result.tensor is into and result.tensor.tolist() == [0, 2, 4, 6] and calls == [1]
    assert buffer.tolist() == [0, 1, 2, 3]


def test_the_group_turns_a_lost_peer_into_collective_error_and_a_moved_epoch_into_epoch_moved():
    buffer = torch.ones(3)
    fake = Fake(done_at=2, error="remote process exited")
    g = group(fake)
    with pytest.raises(CollectiveError, match="epoch 3 NCCL all-reduce: failed: remote process exited"):
        g.allreduce(buffer, lambda: False, watch_every_s=0.001)
    assert buffer.tolist() == [1, 1, 1] and fake.aborted == 1
    with pytest.raises(CollectiveError):  # the communicator is spent: at once, nothing issued
        g.allreduce(buffer, lambda: False, watch_every_s=0.001)
    assert len(fake.issued) == 1
    fake = Fake(form_at=None)
    with pytest.raises(EpochMoved, match="while its communicator formed"):
        group(fake).allreduce(buffer, lambda: fake.form_polls >= 3, watch_every_s=0.001)
    assert fake.issued == [] and fake.aborted == 1
    fake = Fake(done_at=None)
    with pytest.raises(EpochMoved, match="during the all-reduce"):
        group(fake).allreduce(buffer, lambda: fake.done_polls >= 5, watch_every_s=0.001)
    assert buffer.tolist() == [1, 1, 1] and fake.aborted == 1


def test_nccl_is_chosen_only_for_cuda_ranks():
    assert choose("auto", torch.device("cpu")) == "gloo" and choose("auto", "cuda:0") == "nccl"
    assert choose("gloo", "cuda:1") == "gloo" and choose("nccl", "cuda") == "nccl"
    with pytest.raises(ConfigError, match=r"^parallel.cross_backend='nccl': this rank computes on cpu") as e:
        choose("nccl", "cpu")
    assert "\n" not in str(e.value)
    g = epoch_group("auto", torch.device("cpu"), dist.HashStore(), 0, (0,), 0, 5.0)
    assert isinstance(g, EpochGroup)
    assert g.allreduce(torch.ones(2), lambda: False).tensor.tolist() == [1.0, 1.0]
    check("auto", "cpu")
    check("gloo", "auto")
    with pytest.raises(ConfigError, match=r"^parallel.cross_backend='nccl' needs CUDA ranks, and parallel.device='cpu'"):
        check("nccl", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"sees no CUDA device"):
            check("nccl", "auto")


def test_a_cpu_rank_describes_itself():
    assert describe("cpu", "auto") == dict(device="cpu", device_name="cpu", nccl=None, cross_backend="gloo")


def test_each_rank_takes_an_nccl_host_identity_of_its_own_only_when_asked():
    env = {"NCCL_HOSTID": "mine"}
    assert not shares_gpus(env) and hostid_per_rank(env, 1, 0) is None and env == {"NCCL_HOSTID": "mine"}
    ids = set()
    for g in range(3):
        for r in range(2):
            env = {"UNBROKEN_NCCL_HOSTID_PER_RANK": "1"}
            ids.add(hostid_per_rank(env, g, r))
            assert env["NCCL_HOSTID"] == f"unbroken-g{g}-r{r}"
    assert len(ids) == 6


@pytest.mark.parametrize("device", ["cpu", "auto"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_cuda_is_one_line_and_exit_2_with_nothing_started(tmp_path, device):
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--steps", "2", "--parallel.cross_backend=nccl",
                 f"--parallel.device={device}", "--out", str(out), timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "parallel.cross_backend" in r.stderr and "nccl" in r.stderr
    assert not out.exists()


def test_every_rank_records_the_device_it_computes_on(tmp_path):
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--steps", "1", "--microbatches", "2", "--run.progress=false",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    starts = [e for e in read_events(out / "events.jsonl") if e["event"] == "worker_start"]
    assert len(starts) == 2
    for e in starts:
        assert (e["device"], e["device_name"], e["nccl"], e["cross_backend"]) == ("cpu", "cpu", None, "gloo")


def test_a_host_id_per_rank_lets_a_group_have_more_ranks_than_gpus(monkeypatch):
    import unbroken.runtime.parallel.device as device

    monkeypatch.setattr(device, "resolve", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("UNBROKEN_NCCL_HOSTID_PER_RANK", raising=False)
    with pytest.raises(ConfigError, match=r"^parallel.group_size=4: "):
        device.preflight("cuda", 4)
    monkeypatch.setenv("UNBROKEN_NCCL_HOSTID_PER_RANK", "1")
    device.preflight("cuda", 4)  # each rank its own NCCL_HOSTID: NCCL lets them share the GPU
