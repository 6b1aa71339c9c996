"""model.compile: each block torch.compile'd in place (names unchanged), in the step protocol: a compiled run
is bitwise its own failure-free compiled run through a replica killed mid-step whose process torchrun
restarts, recompiles and heals back in (aot_eager: the suite's 2-core host cannot afford inductor's code
generation per rank; benchmarks/compile_step.py times inductor). Where a backend cannot run, the run is
refused before start in one line."""
from __future__ import annotations

import pytest

from tests.conftest import side_by_side, unbroken
from unbroken.events import read_events, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = ["--replicas", "2", "--steps", "16", "--microbatches", "4", "--exact", "--launch.progress=false",
       "--coord.heartbeat_timeout=2.0", "--coord.heartbeat_interval=0.1", "--coord.run_timeout=280",
       "--data.max_files=40", "--model.compile=true", "--model.compile_backend=aot_eager"]


def test_a_compiled_run_through_a_kill_and_a_recompiled_rejoin_matches_its_failure_free_run(tmp_path):
    # the survivor stalls 0.4 s after each compute span of steps 3-13 (wall only) so that it is still training
    # when torchrun's restarted, recompiling replica 1 asks to join
    faults = "kill:replica=1,step=2,phase=compute; slow:replica=0,from=3,to=14,for=0.4"
    ref, killed = side_by_side(
        lambda: unbroken("train", *RUN, "--out", str(tmp_path / "ref")),
        lambda: unbroken("train", *RUN, "--launch.restarts=1", "--launch.launcher=torchrun", "--faults", faults,
                         "--out", str(tmp_path / "killed"), timeout=290))
    assert ref.returncode == 0 and killed.returncode == 0, (ref.stderr[-1500:], killed.stderr[-1500:])
    events = read_events(tmp_path / "killed")
    assert [(e["replica"], e["step"]) for e in events if e["event"] == "fault" and e["kind"] == "kill"] == [(1, 2)]
    # every incarnation compiled its blocks: both replicas at start, replica 1 again after its restart
    compiled = [(e["replica"], e["compiled"]) for e in events if e["event"] == "parallelized"]
    assert sorted(compiled) == [(0, 2), (1, 2), (1, 2)], compiled
    join = next(e for e in events if e["event"] == "join")
    assert (join["replica"], join["restart"]) == (1, 1)
    healed = next(e["step"] for e in events if e["event"] == "heal" and e["side"] == "joiner")
    a, b = steps(read_events(tmp_path / "ref")), steps(events)
    assert b[2]["members"] == [0] and b[15]["members"] == [0, 1] and healed < 14
    assert [a[s]["param_digest"] for s in range(16)] == [b[s]["param_digest"] for s in range(16)]


def test_a_backend_that_cannot_run_here_is_refused_in_one_line(tmp_path, monkeypatch):
    from unbroken.runtime.parallel import precision

    monkeypatch.setattr("shutil.which", lambda name: None)  # a host without a C++ compiler
    assert "needs a C++ compiler" in precision.compile_problem("inductor", "cpu")
    assert precision.compile_problem("aot_eager", "cpu") is None
    monkeypatch.undo()
    r = unbroken("train", "--steps", "2", "--model.compile=true", "--model.compile_backend=tvm",
                 "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "model.compile_backend='tvm'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_compiling_keeps_parameter_names():
    """Snapshots, heals and checkpoints name parameters by module path: compiling in place keeps them."""
    import torch

    from unbroken.config import ModelConfig
    from unbroken.model.llama import Llama
    from unbroken.runtime.parallel.precision import compile_layers

    torch.manual_seed(0)
    model = Llama(ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4))
    names = [n for n, _ in model.named_parameters()]
    compile_layers(model, "eager")
    assert [n for n, _ in model.named_parameters()] == names
    assert all(b._compiled_call_impl is not None for b in model.layers.values())


def test_a_hugging_face_causal_lm_compiles_per_decoder_layer():
    """hf.causal_lm's plan names its decoder layers: each compiles in place and computes the eager loss."""
    transformers = pytest.importorskip("transformers")
    import torch

    from unbroken.model.hf import causal_lm
    from unbroken.runtime.parallel.precision import compile_layers

    torch.manual_seed(0)
    model = causal_lm(transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=16))
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    eager = model(x, x)
    compile_layers(model, "aot_eager")
    compiled = model(x, x)
    compiled.backward()
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert torch.equal(eager, compiled) and all(p.grad is not None for p in model.parameters())
