"""The `--faults` grammar: the docstring's examples parse to the values they describe, defaults fill in,
every kind of bad input is a FaultSpecError naming the offending token, and any valid spec round-trips
through its canonical form (property test)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.faultspec import PHASES, Fault, FaultSpecError, canonical, parse


def test_docstring_examples_parse_to_their_values():
    kill, hang, slow = parse("kill:replica=1,step=10,phase=allreduce; hang:replica=2,step=14,phase=compute,for=8;"
                             "slow:replica=0,from=5,factor=2,to=9", replicas=4, steps=20)
    assert kill == Fault("kill", replica=1, step=10, phase="allreduce")
    assert hang == Fault("hang", replica=2, step=14, phase="compute", seconds=8.0)
    assert slow == Fault("slow", replica=0, factor=2.0, start=5, stop=9)
    assert slow.slows(0, 5) and slow.slows(0, 8) and not slow.slows(0, 9) and not slow.slows(0, 4)
    assert not slow.slows(1, 6) and not kill.slows(1, 10)


def test_defaults_and_whitespace():
    assert parse("", 2, 2) == () and parse(" ; ;", 2, 2) == ()
    (k,) = parse("  kill : replica = 0 , step = 3  ", 2, 5)
    assert k == Fault("kill", replica=0, step=3, phase="compute")  # phase defaults to compute
    (s,) = parse("slow:replica=1,factor=3", 2, 5)
    assert (s.start, s.stop) == (0, None) and s.slows(1, 4)  # slowed from step 0 to the end
    assert s.how == "sleep" and parse("slow:replica=1,factor=3,how=spin", 2, 5)[0].how == "spin"
    (s,) = parse("slow:replica=1,for=0.5,from=2", 2, 5)  # a fixed stall: no factor
    assert (s.factor, s.seconds, s.how, s.start) == (1.0, 0.5, "sleep", 2) and s.slows(1, 2)


def test_bounds_are_the_runs_size():
    assert parse("kill:replica=3,step=9", replicas=4, steps=10)[0].replica == 3
    assert parse("slow:replica=0,factor=1,to=10", replicas=1, steps=10)[0].stop == 10  # `to` may be steps


@pytest.mark.parametrize("spec, token", [
    ("boom:replica=1,step=1", "'boom'"),
    ("kill", "'kill'"),
    ("kill:replica1", "'replica1'"),
    ("kill:replica=,step=1", "'replica='"),
    ("kill:replica=1,replica=0,step=1", "'replica'"),
    ("kill:replica=1,step=1,color=red", "'color'"),
    ("kill:step=1", "replica="),
    ("hang:replica=1,step=1", "for="),
    ("kill:replica=one,step=1", "'one'"),
    ("kill:replica=4,step=1", "replica=4"),
    ("kill:replica=-1,step=1", "replica=-1"),
    ("kill:replica=1,step=10", "step=10"),
    ("kill:replica=1,step=1,phase=backward", "'backward'"),
    ("slow:replica=1,factor=0.5", "factor=0.5"),
    ("slow:replica=1,factor=fast", "'fast'"),
    ("slow:replica=1,factor=2,how=nap", "'nap'"),
    ("slow:replica=1,from=2", "factor= or for="),
    ("slow:replica=1,for=1,how=spin", "'spin'"),
    ("slow:replica=1,for=-1", "for=-1"),
    ("hang:replica=1,step=1,for=-2", "for=-2"),
    ("kill:replica=1,step=1; kill:replica=9,step=1", "replica=9"),
    ("partition:host=2,step=3", "for="),
    ("cut:host=1,peer=1,step=3", "host=1 twice"),
    ("cut:host=1,step=3", "peer="),
    ("rate:host=2,mbit=0", "mbit=0"),
    ("host:host=two,step=1", "'two'"),
])
def test_bad_specs_name_the_token_in_one_line(spec, token):
    with pytest.raises(FaultSpecError) as e:
        parse(spec, replicas=4, steps=10)
    message = str(e.value)
    assert token in message and "\n" not in message


def test_host_and_network_faults_parse_and_only_the_namespace_harness_takes_them():
    """host, partition, cut and rate (tests/cluster/chaos.py injects them); a run's own config refuses them
    in one line naming the kind."""
    from unbroken.api import make_config
    from unbroken.config import ConfigError
    spec = "host:host=2,step=3; partition:host=2,step=3,for=8; cut:host=1,peer=2,step=3,for=4; rate:host=2,mbit=1000"
    lost, part, cut, rate = parse(spec, 2, 10)
    assert lost == Fault("host", host=2, step=3) and part == Fault("partition", host=2, step=3, seconds=8.0)
    assert cut == Fault("cut", host=1, peer=2, step=3, seconds=4.0) and rate == Fault("rate", host=2, mbit=1000)
    assert parse(canonical((lost, part, cut, rate)), 2, 10) == (lost, part, cut, rate)
    with pytest.raises(ConfigError) as e:
        make_config(replicas=2, faults__spec="partition:host=1,step=2,for=3")
    assert "partition acts on hosts made of namespaces" in str(e.value) and "\n" not in str(e.value)


def test_extra_kinds_extend_the_grammar():
    (f,) = parse("nodeloss:node=2,step=3", 4, 10, extra_kinds={"nodeloss": ({"node", "step"}, set())})
    assert (f.kind, f.node, f.step, f.phase) == ("nodeloss", 2, 3, None)
    assert parse(canonical((f,)), 4, 10, extra_kinds={"nodeloss": ({"node", "step"}, set())}) == (f,)


R, S = 8, 50
_num = st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False)
_kill = st.builds(lambda r, s, p: Fault("kill", replica=r, step=s, phase=p),
                  st.integers(0, R - 1), st.integers(0, S - 1), st.sampled_from(PHASES))
_hang = st.builds(lambda r, s, p, t: Fault("hang", replica=r, step=s, phase=p, seconds=t),
                  st.integers(0, R - 1), st.integers(0, S - 1), st.sampled_from(PHASES),
                  st.floats(0.0, 1e4, allow_nan=False))
_slow = st.builds(lambda r, f, a, b, h, t: Fault("slow", replica=r, factor=f, start=a, stop=b, how=h,
                                                 seconds=t if h == "sleep" else 0.0),
                  st.integers(0, R - 1), _num, st.integers(0, S - 1), st.none() | st.integers(0, S),
                  st.sampled_from(["sleep", "spin"]), st.just(0.0) | st.floats(0.0, 1e4, allow_nan=False))


@settings(max_examples=80, deadline=None)
@given(st.lists(_kill | _hang | _slow, max_size=5).map(tuple))
def test_canonical_form_round_trips(faults):
    text = canonical(faults)
    assert parse(text, R, S) == faults
    assert canonical(parse(text, R, S)) == text


def test_flip_faults_parse_with_their_defaults():
    g, p, o = parse("flip:replica=1,step=3,in=grad,microbatch=5; flip:replica=0,step=2,in=param,bit=mantissa,every=3;"
                    "flip:replica=2,step=9,in=optimizer,bit=7,tensor=4,element=11,rank=1", 4, 10, group_size=2)
    assert g == Fault("flip", replica=1, step=3, target="grad", microbatch=5)
    assert (g.bit, g.every, g.tensor, g.element) == ("exponent", None, 0, 0)
    assert p == Fault("flip", replica=0, step=2, target="param", bit="mantissa", every=3)
    assert o == Fault("flip", replica=2, step=9, target="optimizer", bit="7", tensor=4, element=11, rank=1)
    assert [s for s in range(12) if p.flips(0, s)] == [2, 5, 8, 11] and not p.flips(1, 2)
    assert [s for s in range(12) if g.flips(1, s)] == [3]  # once without every=
    assert all(parse(canonical((f,)), 4, 10, group_size=2) == (f,) for f in (g, p, o))


@pytest.mark.parametrize("spec, token", [
    ("flip:replica=1,step=1", "in="),
    ("flip:replica=1,step=1,in=weights", "'weights'"),
    ("flip:replica=1,step=1,in=param,bit=middle", "'middle'"),
    ("flip:replica=1,step=1,in=param,bit=64", "bit=64"),
    ("flip:replica=1,step=1,in=param,every=0", "every=0"),
    ("flip:replica=1,step=1,in=param,microbatch=2", "microbatch="),
    ("flip:replica=1,step=1,in=grad,microbatch=-1", "microbatch=-1"),
    ("flip:replica=1,step=1,in=param,phase=compute", "'phase'"),
])
def test_bad_flip_specs_name_the_token(spec, token):
    with pytest.raises(FaultSpecError) as e:
        parse(spec, replicas=4, steps=10)
    assert token in str(e.value) and "\n" not in str(e.value)
