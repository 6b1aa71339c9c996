"""The config tree: defaults, TOML file < dotted overrides precedence, coercion of CLI strings, one-line
ConfigErrors naming the bad key or value, and the JSON form handed to workers."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from unbroken.config import (MOVED, SECTIONS, Config, ConfigError, build, listing, load, parse_overrides, upgrade,
                             validate)
from unbroken.api import make_config
from unbroken.topology import Topology, TopologyError


def write(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return str(p)


def test_defaults_are_valid():
    cfg = load(None)
    assert cfg == Config() and cfg.run.replicas == 4 and cfg.model.n_layer == 2


def test_toml_then_overrides_take_precedence(tmp_path):
    path = write(tmp_path, '[run]\nsteps = 7\nreplicas = 3\n[model]\nn_layer = 3\n[optim]\nlr = 0.5\n')
    cfg = load(path, parse_overrides(["--run.steps=9", "--model.dropout=0"]))
    assert cfg.run.steps == 9  # override beats file
    assert cfg.run.replicas == 3 and cfg.model.n_layer == 3 and cfg.optim.lr == 0.5  # file beats default
    assert cfg.model.dropout == 0.0 and cfg.run.microbatches == 8  # untouched: default


def test_cli_flags_beat_the_file_too(tmp_path):
    path = write(tmp_path, '[run]\nsteps = 7\n')
    assert load(path, {"run.steps": 3}).run.steps == 3


@pytest.mark.parametrize("key, raw, want", [
    ("run.steps", "12", 12), ("run.exact", "true", True), ("run.exact", "off", False), ("run.exact", "1", True),
    ("optim.lr", "1e-4", 1e-4), ("model.dropout", "0", 0.0), ("data.seq_len", "8-32", "8-32"),
    ("faults.spec", "kill:replica=1,step=2", "kill:replica=1,step=2"), ("optim.lr", 2, 2.0), ("run.steps", 5.0, 5),
])
def test_coercion_from_cli_strings(key, raw, want):
    section, name = key.split(".")
    value = getattr(getattr(build({}, {key: raw}), section), name)
    assert value == want and type(value) is type(want)


@pytest.mark.parametrize("tree, overrides, words", [
    ({}, {"run.steps": "abc"}, "run.steps='abc' is not a valid int"),
    ({}, {"run.steps": 2.5}, "run.steps=2.5"),
    ({}, {"run.exact": "maybe"}, "run.exact='maybe'"),
    ({}, {"run.bogus": "1"}, "unknown config key run.bogus"),
    ({}, {"nope.key": "1"}, "unknown config section 'nope'"),
    ({"run": 3}, {}, "section 'run' must be a table"),
    ({}, {"run.steps": "0"}, "run.steps=0"),
    ({}, {"run.replicas": "0"}, "run.replicas=0"),
    ({}, {"run.microbatches": "0"}, "run.microbatches=0"),
    ({}, {"model.n_head": "5"}, "model.n_embd=64 is not a multiple of model.n_head=5"),
    ({}, {"model.dropout": "1"}, "model.dropout=1.0"),
    ({}, {"coord.heartbeat_timeout": "0.1"}, "coord.heartbeat_timeout"),
    ({}, {"data.path": "/no/such/corpus.txt"}, "data.path='/no/such/corpus.txt': no such file"),
    ({}, {"data.seq_len": "long"}, "data.seq_len='long'"),
    ({}, {"data.seq_len": "65"}, "data.seq_len='65'"),
    ({}, {"run.step_ahead": "always"}, "run.step_ahead='always'"),
    ({}, {"coord.store": "etcd://h:2379/j?failover=-1"}, "coord.store='etcd://h:2379/j?failover=-1': bad option"),
    # the degrees inside a group: group_size = pp x tp x FSDP shards, and what is built of them
    ({}, {"parallel.group_size": "2", "parallel.pp": "3"}, "parallel.group_size=2 is not parallel.pp=3 x"),
    ({}, {"parallel.group_size": "4", "parallel.pp": "2", "parallel.tp": "3"}, "parallel.tp=3"),
    ({}, {"parallel.pp": "0"}, "parallel.pp=0"),
    ({}, {"parallel.on_rank_loss": "replan"}, "parallel.on_rank_loss=replan with parallel.group_size=1"),
    ({}, {"parallel.group_size": "3", "parallel.tp": "3", "data.batch_size": "3"}, "parallel.tp=3 does not divide"),
    ({}, {"parallel.group_size": "4", "parallel.pp": "4"}, "parallel.pp=4: more stages than model.n_layer=2"),
])
def test_validation_is_one_line_naming_the_key(tree, overrides, words):
    with pytest.raises(ConfigError) as e:
        build(tree, overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    ({"parallel.group_size": "2", "parallel.pp": "2", "data.seq_len": "8-32"}, "data.seq_len='8-32'"),
    ({"parallel.group_size": "4", "data.batch_size": "6"}, "does not divide data.batch_size=6"),
])
def test_the_built_in_data_keys_are_held_to_the_layout_only_where_the_built_in_source_feeds_it(overrides, words):
    """A user's data object brings its own shapes (model/data/contract.py): the data.* keys bind only the
    built-in source, so the config itself builds, and the check before start names the key."""
    from unbroken.config.tree import builtin_data_problem
    problem = builtin_data_problem(build({}, overrides))
    assert problem and words in problem and "\n" not in problem


def test_fsdp2_beside_tensor_parallelism_reaches_the_topology_tp_innermost():
    """group_size 4 = 2 FSDP shards x TP 2 (torchtitan's (dp_shard, tp) mesh): ranks 0, 1 are shard 0's TP
    team and take its rows of each microbatch; 2, 3 shard 1's."""
    topology = build({}, {"parallel.group_size": "4", "parallel.tp": "2", "run.replicas": "2"}).topology()
    assert (topology.pp, topology.tp, topology.dp_shard) == (1, 2, 2)
    assert [topology.coords(j) for j in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


def test_fsdp2_inside_pipeline_stages_reaches_the_topology():
    """group_size 4 = 2 stages x 2 FSDP shards (torchtitan's (pp, dp_shard) mesh): ranks 0, 1 hold stage 0."""
    topology = build({}, {"parallel.group_size": "4", "parallel.pp": "2", "run.replicas": "2"}).topology()
    assert (topology.pp, topology.tp, topology.dp_shard) == (2, 1, 2)
    assert [topology.coords(j) for j in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]


def test_all_three_degrees_reach_the_topology_tp_innermost():
    """group_size 8 = 2 stages x 2 FSDP shards x TP 2: rank = (stage x 2 + shard) x 2 + TP index."""
    topology = build({}, {"parallel.group_size": "8", "parallel.pp": "2", "parallel.tp": "2"}).topology()
    assert (topology.pp, topology.tp, topology.dp_shard) == (2, 2, 2)
    assert [topology.coords(j) for j in range(8)] == [(s, k, t) for s in range(2) for k in range(2) for t in range(2)]


def test_pipeline_degrees_reach_the_topology():
    topology = build({}, {"parallel.group_size": "2", "parallel.pp": "2", "run.replicas": "3"}).topology()
    assert (topology.pp, topology.tp, topology.dp_shard, topology.shards) == (2, 1, 1, 2)
    assert [topology.coords(j)[0] for j in range(2)] == [0, 1]  # rank j holds stage j
    with pytest.raises(TopologyError, match="group_size=2 is not a multiple of tp=1 x pp=3"):
        Topology(1, 2, pp=3)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="run.toml"):
        load(write(tmp_path, "[run\nsteps = 1\n"))
    with pytest.raises(ConfigError, match="unknown config key model.layers"):
        load(write(tmp_path, "[model]\nlayers = 1\n"))


def test_parse_overrides():
    assert parse_overrides(["--a.b=1", "--c.d=x=y"]) == {"a.b": "1", "c.d": "x=y"}
    for bad in ("--ab=1", "--a.b", "a.b=1"):
        with pytest.raises(ConfigError, match="unrecognized argument"):
            parse_overrides([bad])


def test_json_round_trip():
    cfg = build({"run": {"steps": 3}, "model": {"n_layer": 1}})
    assert Config.from_json(cfg.to_json()) == cfg


def test_make_config_validates_faults_against_the_run():
    cfg = make_config(replicas=2, steps=5, faults="kill:replica=1,step=4", model__n_layer=1)
    assert cfg.run.replicas == 2 and cfg.model.n_layer == 1
    with pytest.raises(ConfigError, match=r"--faults: replica=2 is out of range"):
        make_config(replicas=2, steps=5, faults="kill:replica=2,step=4")
    with pytest.raises(ConfigError, match="unknown run option 'epochs'"):
        make_config(epochs=3)


# --- discovering the keys: `unbroken config`, docs/config.md, Literal keys, [detector] and [hardware] ---


ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unbroken.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def test_unbroken_config_lists_every_field_of_every_section_with_a_doc():
    r = cli("config")
    assert r.returncode == 0, r.stderr
    rows = [line.split(None, 3) for line in r.stdout.splitlines()]
    want = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [row[0] for row in rows] == want
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(Config)}
    for row in rows:
        assert len(row) == 4 and row[3].strip(), row  # key, type, default, a non-empty doc
    run = {row[0]: row for row in rows}
    assert run["run.recovery"][1:3] == ['"live"|"restart-memory"|"restart-disk"', '"live"']
    assert run["run.steps"][1:3] == ["int", "20"]


def test_unbroken_config_file_shows_the_resolved_values_with_overrides(tmp_path):
    r = cli("config", write(tmp_path, '[run]\nsteps = 7\n[model]\nn_layer = 3\n'), "--run.steps=9",
            "--parallel.device=cpu")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "run.steps = 9" in lines and "model.n_layer = 3" in lines and 'parallel.device = "cpu"' in lines
    assert len(lines) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
    # the output is TOML: it reads back as the same config
    assert build(tomllib.loads(r.stdout)) == load(str(tmp_path / "run.toml"), {"run.steps": "9",
                                                                               "parallel.device": "cpu"})


@pytest.mark.parametrize("args, token", [
    (["--run.recovery=sometimes"], "run.recovery='sometimes'"),
    (["--run.bogus=1"], "run.bogus"),
    (["/no/such/file.toml"], "/no/such/file.toml"),
    (["--detector.min_samples=2"], "detector.min_samples=2"),
    (["--launch.bogus=1"], "unknown config key launch.bogus"),
    (["--run.out=a", "--launch.bogus=1"], "unknown config key launch.bogus"),
    (["--faults.faults=x"], "unknown config key faults.faults"),
])
def test_unbroken_config_bad_input_is_one_line_and_exit_2(args, token):
    r = cli("config", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and token in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("key", [f"{s}.{k}" for s, cls in SECTIONS.items()
                                 for k, tp in typing.get_type_hints(cls).items()
                                 if typing.get_origin(tp) is typing.Literal])
def test_every_literal_key_is_checked_from_its_type(key):
    section, name = key.split(".")
    allowed = typing.get_args(typing.get_type_hints(SECTIONS[section])[name])
    with pytest.raises(ConfigError) as e:
        build({}, {key: "bogus"})
    assert str(e.value) == f"{key}='bogus': expected one of {', '.join(map(repr, allowed))}"
    with pytest.raises(ConfigError, match="expected one of"):  # a config built by hand is checked too
        validate(dataclasses.replace(Config(), **{section: dataclasses.replace(getattr(Config(), section),
                                                                                **{name: "bogus"})}))


def test_literal_keys_include_the_enum_like_ones():
    literal = {f"{s}.{k}" for s, cls in SECTIONS.items() for k, tp in typing.get_type_hints(cls).items()
               if typing.get_origin(tp) is typing.Literal}
    assert literal >= {"run.recovery", "run.step_ahead", "run.quotas", "launch.launcher", "parallel.on_rank_loss",
                       "parallel.device", "snapshot.parity"}


def test_docs_config_md_is_generated_from_the_config():
    assert (ROOT / "docs" / "config.md").read_text() == listing.markdown(), \
        f"docs/config.md is stale: regenerate it with `{listing.REGENERATE}`"


def test_train_help_names_every_section():
    r = cli("train", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert all(f"[{s}]" in text for s in SECTIONS), text


def test_detector_and_hardware_defaults_are_the_policy_defaults():
    from unbroken.policy.detection import DetectorConfig
    from unbroken.policy.stepcost import Hardware
    from unbroken.runtime.coordinator.replan import group_shape
    from unbroken.runtime.coordinator.slowness import detector_for
    d = detector_for(Config().detector)
    assert d.config == DetectorConfig()
    p = d.predictor
    assert (p.window, p.refit_every, p.min_samples) == (256, 64, 12)
    assert group_shape(Config()).hardware() == Hardware() and group_shape(Config()).locate_steps == 4
    tuned = build({}, {"detector.drift_ratio": "1.2", "hardware.pp_bytes_per_s": "1e9"})
    assert detector_for(tuned.detector).config.drift == math.log(1.2)
    assert group_shape(tuned).hardware().pp_bytes_per_s == 1e9


def test_a_moved_key_is_read_under_its_old_name():
    assert build({}, {"parallel.reform_seconds": "0.1"}).hardware.reform_seconds == 0.1
    assert build({"parallel": {"reform_seconds": 0.5}}).hardware.reform_seconds == 0.5  # an old run's config.json


# --- [run], [faults], [launch]: the split of the old [run], and its old names ---


def test_run_faults_and_launch_hold_exactly_their_keys():
    names = {s: [f.name for f in dataclasses.fields(SECTIONS[s])] for s in ("run", "faults", "launch")}
    assert names == {"run": ["replicas", "steps", "microbatches", "seed", "exact", "threads", "quotas", "recovery",
                             "step_ahead"],
                     "faults": ["spec"],
                     "launch": ["out", "progress", "launcher", "restarts", "max_job_restarts", "pin_cores"]}


# each old [run] key with a value that is not its default, and what that value needs (in new names)
OLD = [("run.faults", "kill:replica=1,step=2", {}), ("run.out", "OUT", {}), ("run.progress", False, {}),
       ("run.launcher", "torchrun", {}), ("run.restarts", 2, {"launch.launcher": "torchrun"}),
       ("run.max_job_restarts", 3, {}), ("run.pin_cores", True, {})]


def test_the_old_names_are_the_run_keys_that_moved():
    assert {old: MOVED[old] for old, _, _ in OLD} == {k: v for k, v in MOVED.items() if k.startswith("run.")}


@pytest.mark.parametrize("old, value, needs", OLD)
def test_an_old_run_key_gives_the_config_of_its_new_name(tmp_path, old, value, needs):
    new = MOVED[old]
    value = str(tmp_path / "out") if value == "OUT" else value  # make_config tries the directory
    want = build({}, {new: value, **needs})
    assert getattr(getattr(want, new.split(".")[0]), new.split(".")[1]) == value != \
        getattr(getattr(Config(), new.split(".")[0]), new.split(".")[1])
    # a flag, as a CLI string
    assert build({}, {old: str(value).lower(), **needs}) == want
    # a TOML file's [run] table
    (tmp_path / "old.toml").write_text(f"[run]\n{old[4:]} = {listing.value(value)}\n")
    assert load(str(tmp_path / "old.toml"), needs) == want
    # an old run's config.json: every key under [run], as runs were written before the split
    tree = json_tree(want)
    assert "faults" not in tree and "launch" not in tree and old[4:] in tree["run"]
    assert Config.from_json(json.dumps(tree)) == want
    # a keyword of the Python API (flat, or section__key)
    kw = {k.replace(".", "__"): v for k, v in needs.items()}
    assert make_config(**{old[4:]: value}, **kw) == make_config(**{new.replace(".", "__"): value}, **kw) == want
    assert make_config(**{old.replace(".", "__"): value}, **kw) == want


def json_tree(cfg: Config) -> dict:
    """cfg's config.json as a run written before [faults] and [launch] would hold it."""
    tree = json.loads(cfg.to_json())
    faults, launch = tree.pop("faults"), tree.pop("launch")
    tree["run"].update(faults=faults["spec"], **launch)
    return tree


def test_an_old_flag_beats_the_new_key_in_a_file_and_both_names_in_one_file_are_refused(tmp_path):
    path = write(tmp_path, '[launch]\nout = "a"\n')
    assert load(path, {"run.out": "b"}).launch.out == "b"
    assert load(write(tmp_path, '[run]\nout = "a"\n'), {"launch.out": "b"}).launch.out == "b"
    with pytest.raises(ConfigError, match="run.out and launch.out are both set") as e:
        load(write(tmp_path, '[run]\nout = "a"\n[launch]\nout = "b"\n'))
    assert "\n" not in str(e.value)
    assert upgrade({"run": {"out": "a", "steps": 2}}) == {"run": {"steps": 2}, "launch": {"out": "a"}}


def test_unbroken_config_shows_only_the_new_names(tmp_path):
    listed = [line.split()[0] for line in cli("config").stdout.splitlines()]
    assert not set(listed) & set(MOVED) and {"faults.spec", "launch.out", "launch.restarts"} <= set(listed)
    r = cli("config", write(tmp_path, '[run]\nrestarts = 1\nlauncher = "torchrun"\n'), "--run.out=o",
            "--run.faults=kill:replica=1,step=2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert {'launch.out = "o"', "launch.restarts = 1", 'launch.launcher = "torchrun"',
            'faults.spec = "kill:replica=1,step=2"'} <= set(lines)
    assert not [line for line in lines if line.split(" = ")[0] in MOVED]
    assert all(old in listing.markdown() for old in MOVED)  # docs/config.md names the old names


def test_resume_reads_old_names_as_new_ones_when_it_checks_its_overrides(tmp_path):
    from unbroken.runtime.launcher.resume import read_run
    for key in ("run.faults", "faults.spec", "run.out", "launch.restarts", "run.launcher"):
        with pytest.raises(ConfigError, match="a resumed run keeps the settings"):
            read_run(tmp_path, {key: "x"})
    for key in ("run.progress", "launch.progress"):  # may change: the next check is the directory's
        with pytest.raises(ConfigError, match="is not a run directory"):
            read_run(tmp_path, {key: "false"})
