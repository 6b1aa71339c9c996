"""The `--faults` grammar, parsed into frozen values. No torch, no processes: injecting is runtime's job.

    SPEC   := FAULT (";" FAULT)*
    FAULT  := KIND ":" KEY "=" VALUE ("," KEY "=" VALUE)*
    kill:replica=1,step=10,phase=allreduce      SIGKILL the replica's process at that point
    hang:replica=2,step=14,phase=compute,for=8  SIGSTOP it there, SIGCONT after `for` seconds
    slow:replica=0,from=5,factor=2[,to=9][,how=spin]   stretch each microbatch's compute by `factor`
                                                (how=sleep, the default; spin: burn the CPU meanwhile;
                                                throttle: burn it to F x the unslowed time of the same work)
    slow:replica=0,from=5,for=0.5[,to=9]        sleep 0.5 s after each compute span (how=sleep only):
                                                a fixed host-side stall, the same on a fast host and a slow one
    node:node=1,step=12                         lose node 1 (its snapshot agent, its memory, its trainers)
    node:node=1,step=12,phase=parity            the same, inside the node's parity encode of the snapshot
                                                of step 12 (or the first one after it): see launcher/chaos.py
    crash-all:step=20                           SIGKILL every trainer at once (a software failure)
    corrupt:replica=1,step=15                   flip bytes in replica 1's stored snapshot of step 15
    tear:replica=0,step=9                       SIGKILL replica 0 while it copies its snapshot of step 9
    flip:replica=1,step=6,in=param[,bit=exponent][,every=3][,tensor=0][,element=0]
                                                flip one bit of replica 1's state (in=param or optimizer:
                                                after step 6's optimizer step, before its digest) or of
                                                one microbatch's gradient (in=grad[,microbatch=I]: as its
                                                backward produces it; no microbatch=: the replica's first
                                                of the step); bit=exponent (the exponent's top bit),
                                                mantissa (the mantissa's top bit), sign, or an index
                                                0..width-1 of the element's dtype; every=K: again at
                                                step+K, step+2K, ... (a device that keeps corrupting)
Host and network faults, acted on hosts made of Linux namespaces (tests/cluster/: `unbroken train` and
`unbroken coordinator` refuse them; the harness injects them, at the first commit of `step` or later):
    host:host=2,step=3                          lose host 2: its PID namespace killed, its link down
    partition:host=2,step=3,for=8               host 2's link down for 8 s, its processes running
    cut:host=1,peer=2,step=3[,for=8]            hosts 1 and 2 cannot reach each other (both reach the rest)
    rate:host=2,mbit=1000                       host 2's link limited to 1000 Mbit/s from the start (tbf)
kill, hang, slow and flip take `rank=J` in a replica group of several ranks (default 0): that rank's process.

Phases of step s (kill and hang): `compute` after the replica's first microbatch, `overlap` as the first
bucket of its all-reduce is issued inside its last microbatch's backward (one-rank groups on gloo, where
the reduction overlaps backward; elsewhere as `allreduce`), `allreduce` as its all-reduce is issued (the
last of its buckets), `commit` once the all-reduce succeeded, before the replica adds itself to the
done count (so the step can only be retried: its peers, which may have stepped their optimizers ahead,
must undo that), `optimizer` once the commit decision is known, before the replica applies it, `eval`
after the replica's first evaluation microbatch of the parameters committed after step s (eval.every).

Steps count from 0. Owns parsing and validation against the run's size; every error is a FaultSpecError
whose message names the offending token in one line.
"""
from __future__ import annotations

from dataclasses import dataclass

PHASES = ("compute", "overlap", "allreduce", "commit", "optimizer", "eval")
FLIP_TARGETS = ("grad", "param", "optimizer")  # flip: in= (what the flipped bit is in)
NAMED_BITS = ("exponent", "mantissa", "sign")  # flip: bit= by name (else an index)
NODE_PHASES = ("parity",)  # node: lost inside its agent's parity encode (the snapshot agents' phase)


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    replica: int | None = None
    step: int | None = None
    phase: str | None = None
    seconds: float = 0.0  # hang: how long the process stays stopped; slow: a fixed sleep per compute span
    factor: float = 1.0  # slow
    start: int = 0  # slow: first slowed step
    stop: int | None = None  # slow: first step no longer slowed (None: to the end)
    node: int | None = None
    how: str = "sleep"  # slow: how the stretch passes, "sleep", "spin" or "throttle" (docs/failslow.md)
    rank: int = 0  # kill, hang, slow, flip: which rank of the replica group
    host: int | None = None  # host, partition, cut, rate: which host (tests/cluster's index)
    peer: int | None = None  # cut: the other host
    mbit: int = 0  # rate: the link's rate, Mbit/s
    target: str | None = None  # flip: "grad", "param" or "optimizer"
    bit: str = "exponent"  # flip: a name of NAMED_BITS or a bit index, as text ("7")
    every: int | None = None  # flip: again every `every` steps from `step` (None: once)
    microbatch: int | None = None  # flip in=grad: which microbatch (None: the replica's first of the step)
    tensor: int = 0  # flip: which parameter (unique_parameters order), or whose optimizer state
    element: int = 0  # flip: which element of it (flat index, modulo its size)

    def flips(self, replica: int, step: int) -> bool:
        """Whether this `flip` fault fires in `replica` at `step` (once, or every `every` steps from `step`)."""
        if self.kind != "flip" or self.replica != replica or self.step is None or step < self.step:
            return False
        return step == self.step or (self.every is not None and (step - self.step) % self.every == 0)

    def slows(self, replica: int, step: int) -> bool:
        return (self.kind == "slow" and self.replica == replica and step >= self.start
                and (self.stop is None or step < self.stop))


# kind -> (required keys, optional keys)
_KEYS: dict[str, tuple[set[str], set[str]]] = {
    "kill": ({"replica", "step"}, {"phase", "rank"}),
    "hang": ({"replica", "step", "for"}, {"phase", "rank"}),
    "slow": ({"replica"}, {"factor", "for", "from", "to", "how", "rank"}),  # factor=, for= or both
    "node": ({"node", "step"}, {"phase"}),
    "crash-all": ({"step"}, set()),
    "corrupt": ({"replica", "step"}, set()),
    "tear": ({"replica", "step"}, set()),
    "host": ({"host", "step"}, set()),
    "partition": ({"host", "step", "for"}, set()),
    "cut": ({"host", "peer", "step"}, {"for"}),
    "rate": ({"host", "mbit"}, set()),
    "flip": ({"replica", "step", "in"}, {"bit", "every", "microbatch", "tensor", "element", "rank"}),
}
NETWORK_KINDS = ("host", "partition", "cut", "rate")  # act on hosts made of namespaces only


def parse(spec: str, replicas: int, steps: int, extra_kinds: dict[str, tuple[set[str], set[str]]] | None = None,
          group_size: int = 1) -> tuple[Fault, ...]:
    """Parse and validate a fault spec for a run of `replicas` replica groups of `group_size` ranks and
    `steps` steps.

    Raises FaultSpecError naming the bad token. An empty spec is no faults.
    """
    kinds = {**_KEYS, **(extra_kinds or {})}
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, sep, body = part.partition(":")
        kind = kind.strip()
        if kind not in kinds:
            raise FaultSpecError(f"unknown fault kind {kind!r} in {part!r} (known: {', '.join(kinds)})")
        if not sep or not body.strip():
            raise FaultSpecError(f"fault {part!r} has no arguments (expected {kind}:key=value,...)")
        kv: dict[str, str] = {}
        for item in body.split(","):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or not key or not value:
                raise FaultSpecError(f"malformed argument {item.strip()!r} in {part!r} (expected key=value)")
            if key in kv:
                raise FaultSpecError(f"argument {key!r} given twice in {part!r}")
            kv[key] = value
        required, optional = kinds[kind]
        for key in kv:
            if key not in required | optional:
                raise FaultSpecError(f"unknown argument {key!r} for {kind} in {part!r}")
        for key in sorted(required - kv.keys()):
            raise FaultSpecError(f"{kind} needs {key}= in {part!r}")
        faults.append(_build(kind, kv, part, replicas, steps, group_size))
    return tuple(faults)


def _int(kv: dict[str, str], key: str, part: str, lo: int, hi: int | None) -> int:
    try:
        v = int(kv[key])
    except ValueError:
        raise FaultSpecError(f"{key}={kv[key]!r} is not an integer in {part!r}") from None
    if v < lo or (hi is not None and v >= hi):
        bound = f"0..{hi - 1}" if hi is not None else f">= {lo}"
        raise FaultSpecError(f"{key}={v} is out of range ({bound}) in {part!r}")
    return v


def _float(kv: dict[str, str], key: str, part: str, lo: float) -> float:
    try:
        v = float(kv[key])
    except ValueError:
        raise FaultSpecError(f"{key}={kv[key]!r} is not a number in {part!r}") from None
    if not v >= lo:
        raise FaultSpecError(f"{key}={v} must be >= {lo} in {part!r}")
    return v


def _build(kind: str, kv: dict[str, str], part: str, replicas: int, steps: int, group_size: int = 1) -> Fault:
    f: dict = {"kind": kind}
    if "replica" in kv:
        f["replica"] = _int(kv, "replica", part, 0, replicas)
    if "rank" in kv:
        f["rank"] = _int(kv, "rank", part, 0, group_size)
    if "node" in kv:
        f["node"] = _int(kv, "node", part, 0, None)
    if "step" in kv:
        f["step"] = _int(kv, "step", part, 0, steps)
    for key in ("host", "peer", "mbit"):
        if key in kv:
            f[key] = _int(kv, key, part, 1 if key == "mbit" else 0, None)
    if kind == "cut" and f["host"] == f["peer"]:
        raise FaultSpecError(f"cut needs two hosts, host={f['host']} twice in {part!r}")
    if "phase" in kv:
        phases = NODE_PHASES if kind == "node" else PHASES
        if kv["phase"] not in phases:
            raise FaultSpecError(f"unknown phase {kv['phase']!r} in {part!r} (phases: {', '.join(phases)})")
        f["phase"] = kv["phase"]
    elif kind in ("kill", "hang"):
        f["phase"] = "compute"
    if "for" in kv:
        f["seconds"] = _float(kv, "for", part, 0.0)
    if "factor" in kv:
        f["factor"] = _float(kv, "factor", part, 1.0)
    if "from" in kv:
        f["start"] = _int(kv, "from", part, 0, steps)
    if "to" in kv:
        f["stop"] = _int(kv, "to", part, 0, steps + 1)
    if "how" in kv:
        if kv["how"] not in ("sleep", "spin", "throttle"):
            raise FaultSpecError(f"how={kv['how']!r} is not sleep, spin or throttle in {part!r}")
        f["how"] = kv["how"]
    if kind == "flip":
        f.update(_flip(kv, part))
    if kind == "slow" and not {"factor", "for"} & kv.keys():
        raise FaultSpecError(f"slow needs factor= or for= in {part!r}")
    if kind == "slow" and "for" in kv and f.get("how", "sleep") != "sleep":
        raise FaultSpecError(f"for= is a sleep: how={kv['how']!r} cannot take it in {part!r}")
    return Fault(**f)


def _flip(kv: dict[str, str], part: str) -> dict:
    """The flip-only keys of `kv`, checked (a bit index's upper bound is the element's width: 64)."""
    f: dict = {}
    if kv["in"] not in FLIP_TARGETS:
        raise FaultSpecError(f"in={kv['in']!r} is not {', '.join(FLIP_TARGETS)} in {part!r}")
    f["target"] = kv["in"]
    if "bit" in kv:
        f["bit"] = kv["bit"] if kv["bit"] in NAMED_BITS else str(_int(kv, "bit", part, 0, 64))
    if "every" in kv:
        f["every"] = _int(kv, "every", part, 1, None)
    if "microbatch" in kv:
        if f["target"] != "grad":
            raise FaultSpecError(f"microbatch= needs in=grad in {part!r}")
        f["microbatch"] = _int(kv, "microbatch", part, 0, None)
    for key in ("tensor", "element"):
        if key in kv:
            f[key] = _int(kv, key, part, 0, None)
    return f


def canonical(faults: tuple[Fault, ...]) -> str:
    """The spec text of parsed faults, keys in a fixed order: `parse(canonical(fs), R, S) == fs`.

    For logs and messages that must show what will be injected, whatever spelling the user typed.
    """
    parts = []
    for f in faults:
        slow = f.kind == "slow"
        kv = [("replica", f.replica), ("node", f.node), ("step", f.step), ("phase", f.phase),
              ("for", f.seconds if f.kind in ("hang", "partition") or f.seconds else None),
              ("factor", f.factor if slow or f.factor != 1.0 else None),
              ("from", f.start if slow or f.start else None), ("to", f.stop),
              ("how", f.how if f.how != "sleep" else None), ("rank", f.rank or None),
              ("host", f.host), ("peer", f.peer), ("mbit", f.mbit or None)]
        if f.kind == "flip":
            kv += [("in", f.target), ("bit", f.bit), ("every", f.every), ("microbatch", f.microbatch),
                   ("tensor", f.tensor or None), ("element", f.element or None)]
        parts.append(f"{f.kind}:" + ",".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in kv if v is not None))
    return "; ".join(parts)
