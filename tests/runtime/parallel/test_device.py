"""Which device a rank computes on (runtime/parallel/device.py), and the GPU path end to end.

On this CPU-only machine the unit tests check the choices (device, GPU index, backend, NCCL settings) and
that asking for CUDA where there is none is bad input; the `gpu` tests run a real job on CUDA where a GPU
is visible and skip otherwise. They have run on one GPU only (docs/parallelism.md, GPUs).
"""
from __future__ import annotations

import gc
import json

import pytest
import torch

from tests.conftest import unbroken
from unbroken.config import ConfigError
from unbroken.runtime.parallel.accumulator import Accumulator, param_digest
from unbroken.runtime.parallel.device import (backend, bind, check_gpus, exact_kernels, gpu_index, nccl_environment,
                                              preflight, resolve)

pytestmark = pytest.mark.timeout(240)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_auto_is_the_gpu_where_one_is_visible_else_the_cpu():
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve("cpu") == torch.device("cpu")
    assert bind(torch.device("cpu"), {"LOCAL_RANK": "3"}) == torch.device("cpu")  # nothing to bind on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"parallel.device='cuda'"):
        resolve("cuda")


def test_each_rank_takes_its_own_gpu():
    # a cluster's torchrun job: its node-local index
    assert [gpu_index({"LOCAL_RANK": str(j), "RANK": str(8 + j)}, 4) for j in range(4)] == [0, 1, 2, 3]
    # the local launcher: group r's ranks from r x G (one agent per rank makes every LOCAL_RANK 0)
    laid = [gpu_index({"UNBROKEN_DEVICE_BASE": str(r * 2), "RANK": str(j), "LOCAL_RANK": "0"}, 8)
            for r in range(3) for j in range(2)]
    assert laid == [0, 1, 2, 3, 4, 5]
    assert gpu_index({"UNBROKEN_DEVICE_BASE": "6", "RANK": "1"}, 4) == 3  # more ranks than GPUs: wrap around


def test_the_group_backend_and_nccl_settings():
    assert backend(torch.device("cpu")) == "gloo"
    assert backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"  # CPU tensors of the protocol over gloo
    env = {"TORCH_NCCL_BLOCKING_WAIT": "0"}
    nccl_environment(env)
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # the user's kept


def test_a_group_with_more_ranks_than_gpus_is_refused_in_one_line():
    check_gpus(2, 2)
    check_gpus(1, 1)
    with pytest.raises(ConfigError, match=r"^parallel.group_size=3: .* this host sees 2 ") as e:
        check_gpus(3, 2)
    assert "\n" not in str(e.value)
    preflight("cpu", 8)  # CPU ranks share a host freely
    if not torch.cuda.is_available():
        preflight("auto", 8)  # auto is the CPU here
        with pytest.raises(ConfigError, match=r"parallel.device='cuda'"):
            preflight("cuda", 1)


def test_exact_kernels_leave_the_cpu_as_it_is():
    exact_kernels(torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_accumulator_lives_on_its_parameters_device():
    params = [torch.nn.Parameter(torch.ones(3, device="meta")), torch.nn.Parameter(torch.ones(2, device="meta"))]
    acc = Accumulator(params, torch.float64)
    assert acc.buffer.device.type == "meta" and acc.buffer.shape == (6,)


def test_the_digest_is_the_same_bytes_from_a_non_contiguous_copy():
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    q = torch.nn.Parameter(p.detach().t().contiguous().t())  # same values, other strides
    assert param_digest([p]) == param_digest([q])


def test_the_digest_s_kept_views_read_in_place_updates_new_storage_and_go_with_their_tensor():
    """`_chunks` keeps a numpy view a parameter: an optimizer's in-place step shows in the next digest,
    a parameter given other memory (`.data =`, as a restore may) is read there, and a parameter that
    dies takes its entry with it."""
    import xxhash

    from unbroken.runtime.parallel import accumulator as gradients

    def fresh(p):  # the digest without any kept view
        return xxhash.xxh3_128(p.detach().numpy().tobytes()).hexdigest()
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    first = param_digest([p])
    assert first == fresh(p) and id(p) in gradients._VIEWS
    with torch.no_grad():
        p.add_(1.0)  # in place: the same memory
    assert param_digest([p]) == fresh(p) != first
    p.data = torch.zeros(6)  # other memory under the same Parameter
    assert param_digest([p]) == fresh(p) == xxhash.xxh3_128(bytes(24)).hexdigest()
    key = id(p)
    del p
    gc.collect()
    assert key not in gradients._VIEWS


def test_bad_device_values_are_one_line_and_exit_2(tmp_path):
    r = unbroken("train", "--steps", "1", "--parallel.device=tpu", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "parallel.device='tpu'" in r.stderr, r.stderr
    assert not (tmp_path / "a").exists()
    if not torch.cuda.is_available():
        r = unbroken("train", "--steps", "1", "--parallel.device=cuda", "--out", str(tmp_path / "b"))
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "parallel.device='cuda'" in r.stderr, \
            r.stderr
        assert not (tmp_path / "b").exists()


def events(out) -> list[dict]:
    """The run's events, after checking that every rank computed on CUDA and reduced across groups on
    NCCL (a silent CPU fallback would pass the rest of a test)."""
    ev = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    starts = [e for e in ev if e["event"] == "worker_start"]
    assert starts and all(e["device"].startswith("cuda:") and e["nccl"] and e["cross_backend"] == "nccl"
                          for e in starts), starts
    return ev


@pytest.mark.gpu
@pytest.mark.slow
@cuda
def test_one_rank_replicas_on_cuda_survive_a_kill_with_every_microbatch_reduced(tmp_path):
    """2 replicas on the GPU(s) (both on GPU 0 when there is one), a kill in compute: the audit finds every
    step reduced exactly its microbatches, and the kill fired."""
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--steps", "6", "--microbatches", "4", "--exact", "--run.progress=false",
                 "--parallel.device=cuda", "--faults", "kill:replica=1,step=2,phase=compute", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    audit = unbroken("audit", str(out))
    assert audit.returncode == 0 and "audit: 0 problems" in audit.stdout, audit.stdout + audit.stderr
    fired = [e for e in events(out) if e["event"] == "fault"]
    assert [(e["replica"], e["step"]) for e in fired] == [(1, 2)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (an NCCL group of 2 ranks)")
def test_an_fsdp2_group_on_nccl_loses_a_rank_and_the_other_group_finishes(tmp_path):
    """2 groups of 2 ranks, each rank its own GPU when there are 4 (else shared round-robin): NCCL inside
    the group, gloo across groups. A rank of group 1 killed in compute: its group leaves, group 0 finishes
    with a clean audit."""
    out = tmp_path / "run"
    r = unbroken("train", "--replicas", "2", "--parallel.group_size=2", "--steps", "6", "--microbatches", "4",
                 "--exact", "--run.progress=false", "--parallel.device=cuda", "--coord.heartbeat_timeout=5",
                 "--coord.collective_timeout=20", "--faults", "kill:replica=1,rank=1,step=2,phase=compute",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    audit = unbroken("audit", str(out))
    assert audit.returncode == 0 and "audit: 0 problems" in audit.stdout, audit.stdout + audit.stderr
    ev = events(out)
    assert [(e["replica"], e.get("rank"), e["step"]) for e in ev if e["event"] == "fault"] == [(1, 1, 2)]
    assert all(e["members"] == [0] for e in ev if e["event"] == "step" and e["step"] > 3)


@pytest.mark.gpu
@pytest.mark.slow
@cuda
def test_under_exact_a_kill_on_cuda_leaves_every_digest_the_failure_free_runs(tmp_path):
    """--exact on CUDA: the redone microbatches' gradients are the same bits (exact_kernels), so a run
    that loses a replica in compute has the failure-free run's digest at every step."""
    runs = {}
    for name, faults in (("ref", ""), ("kill", "kill:replica=1,step=2,phase=compute")):
        runs[name] = tmp_path / name
        r = unbroken("train", "--replicas", "2", "--steps", "6", "--microbatches", "4", "--exact",
                     "--run.progress=false", "--parallel.device=cuda", "--faults", faults, "--out", str(runs[name]))
        assert r.returncode == 0, r.stderr[-2000:]
    assert [(e["replica"], e["step"]) for e in events(runs["kill"]) if e["event"] == "fault"] == [(1, 2)]
    c = unbroken("compare", str(runs["ref"]), str(runs["kill"]))
    assert c.returncode == 0 and "identical: 6/6" in c.stdout, c.stdout + c.stderr


@pytest.mark.gpu
@cuda
def test_a_group_with_more_ranks_than_the_hosts_gpus_is_one_line_and_exit_2(tmp_path):
    size = torch.cuda.device_count() + 1
    r = unbroken("train", "--replicas", "2", f"--parallel.group_size={size}", "--data.batch_size=" + str(4 * size),
                 "--steps", "1", "--parallel.device=cuda", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"parallel.group_size={size}" in r.stderr and not (tmp_path / "a").exists(), r.stderr
