"""The 131,072-GPU member of the scenario family: same seed, same log; the family's rates scale with size;
the simulator's fast paths give exactly the values of the plain ones."""
from __future__ import annotations

import dataclasses
import random

import pytest

from unbroken.policy.detection import Detector
from unbroken.policy.predictor import MicrobatchTiming, SameWork
from unbroken.sim.gauss import GaussStream
from unbroken.sim.runner import simulate
from unbroken.sim.scenario import load
from unbroken.sim.strategies import STRATEGIES

FAMILY = {"1k": 1024, "16k": 16384, "131k": 131072}


def short(name: str, hours: float):
    sc = load(f"scenarios/llama3_{name}.toml")
    return dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, duration_hours=hours))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_131k_same_seed_same_log(strategy):
    # 1.5 h of the 131K scenario at full DP 1,024: ~4 interruptions expected (one every 23 min)
    sc = short("131k", 1.5)
    a = simulate(sc, strategy, seed=11, keep=True)
    b = simulate(sc, strategy, seed=11, keep=True)
    assert a.digest == b.digest and a.records == b.records
    assert a.end["tokens"] > 0 and a.records[0]["gpus"] == 131072
    assert sum(r["event"] == "fault" for r in a.records) >= 2  # failures did happen, and were replayed alike


def test_family_rates_grow_with_components():
    rates = {n: load(f"scenarios/llama3_{n}.toml") for n in FAMILY}
    for n, sc in rates.items():
        assert sc.cluster.gpus == FAMILY[n] and sc.cluster.tp == 8 and sc.cluster.pp == 16
        assert {"cluster.dp", "workload.duration_hours"} <= set(sc.chosen) or n == "16k"
    base = rates["16k"]
    for n, sc in rates.items():
        k = sc.cluster.gpus / base.cluster.gpus
        for c, c16 in zip(sc.causes, base.causes):  # the same causes, each rate x the GPU count
            assert c.name == c16.name
            assert c.rate_per_second(sc.cluster.gpus) == pytest.approx(k * c16.rate_per_second(base.cluster.gpus))
        # the same GPU-hours in each member, so the same expected interruptions (419 unexpected)
        assert sc.failure_rate() * sc.workload.duration_hours * 3600 == pytest.approx(419, rel=1e-9)


def test_gauss_stream_is_random_gauss():
    for seed in range(3):
        ref, src = random.Random(f"engine:{seed}"), random.Random(f"engine:{seed}")
        stream = GaussStream(src)
        got = [x for n in (1, 2, 17, 70_000, 3) for x in stream.take(n).tolist()]
        assert got == [ref.gauss(0.0, 1.0) for _ in got]
        assert [0.0 + z * 0.05 for z in got[:100]] == [random.Random(f"engine:{seed}").gauss(0.0, 0.05)
                                                      for _ in range(1)] + [0.0 + z * 0.05 for z in got[1:100]]
    src = random.Random(1)
    src.gauss()
    with pytest.raises(ValueError):
        GaussStream(src)  # a cached second deviate would be skipped: refused


def test_same_work_scores_as_plain_timings():
    rng = random.Random(4)
    a, b = Detector(), Detector()
    for step in range(60):
        timings = {r: [rng.lognormvariate(-1.0, 0.05) * (1.6 if r == 3 and step > 30 else 1.0) for _ in range(8)]
                   for r in range(12)}
        va = a.observe(step, {r: SameWork(8192, 8192.0 ** 2, s) for r, s in timings.items()})
        vb = b.observe(step, {r: [MicrobatchTiming(8192, 8192.0 ** 2, x) for x in s] for r, s in timings.items()})
        assert va == vb and a.speeds() == b.speeds() and a.noise() == b.noise()
        assert a.take_events() == b.take_events()
    assert a.verdicts()[3].value == "slow"  # the 1.6x replica was found, by both
    with pytest.raises(ValueError):
        SameWork(1, 1.0, [0.5, 0.0])


def test_cost_model_prices_bytes_at_the_stated_links(capsys):
    from unbroken.sim import calibrate, costmodel
    sc16, sc131 = load("scenarios/llama3_16k.toml"), load("scenarios/llama3_131k.toml")
    c16 = {c.name: c for c in costmodel.derive(sc16)}
    c131 = {c.name: c for c in costmodel.derive(sc131)}
    per_gpu = 126 * 51.2e9 / 128  # the 405B state of one rank of a TP 8 x PP 16 group
    assert c16["rejoin_seconds"].seconds == pytest.approx(11.8 + per_gpu / 50e9)
    # the snapshot share is the rank's state over DP: 8x more groups, an 8x smaller copy
    copy16 = c16["snapshot_seconds"].seconds - 0.00135
    assert c131["snapshot_seconds"].seconds - 0.00135 == pytest.approx(copy16 / 8)
    # gloo through host memory is priced apart from NCCL, and far above it
    assert c16["reduce_gloo_host_per_step"].seconds > 50 * c16["reduce_nccl_per_step"].seconds
    for c in c16.values():
        assert c.seconds > 0 and c.inputs and all(k in costmodel.FIGURES for k in c.inputs)
    assert calibrate.main(["costs", "scenarios/llama3_16k.toml"]) == 0
    out = capsys.readouterr().out
    assert "reduce_gloo_host_per_step" in out and "PCI-SIG" in out and "measured here" in out
    assert calibrate.main(["costs", "nope.toml"]) == 2
    assert calibrate.main([]) == 2


@pytest.mark.timeout(60)
def test_cli_family_writes_one_table_and_plot(tmp_path, capsys):
    from unbroken.sim import cli
    # the family at 1K and 131K for 1 h each, two strategies: one table row per size and strategy
    paths = []
    for n in ("1k", "131k"):
        lines = open(f"scenarios/llama3_{n}.toml").read().splitlines()
        text = "\n".join("duration_hours = 1.0" if x.startswith("duration_hours") else x for x in lines)
        paths.append(tmp_path / f"{n}.toml")
        paths[-1].write_text(text)
    out = tmp_path / "out"
    args = [str(p) for p in paths] + ["--out", str(out), "--strategy", "checkpoint_restart",
                                      "--strategy", "unbroken_live"]
    assert cli.main(["sim", *args]) == 0
    table = (out / "family.md").read_text()
    sizes = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert sizes == ["1,024", "1,024", "131,072", "131,072"] and "1.000x" in table
    assert (out / "family.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "llama3-131k" / "unbroken_live" / "events.jsonl").stat().st_size > 0
    capsys.readouterr()
    assert cli.main(["sim", str(paths[0]), str(tmp_path / "missing.toml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.toml" in err[0]
