"""Heal over a slow link: a group on a host whose link is limited to 1 Gbit/s (tbf), killed, restarted by
torchrun and healed from the donor on another host; the heal's bandwidth over the link's rate.

Hosts made of Linux namespaces (tests/cluster/hosts.py; needs root): the coordinator on host 0, group 0's
torchrun on host 1, group 1's forkrun on host 2, docs/cluster.md's lines as written but for the address,
`--max-restarts=1` and a wider model (more bytes to heal). Host 2's link is limited to `--mbit` both ways
(tbf on its eth0 and on the switch's end) before the run starts; `kill:replica=1,step=S` SIGKILLs group 1's
rank, its agent restarts it, it is admitted, and its rank takes the donor's parameters and optimizer state
across the limited link (the `heal` records: bytes and `transfer` seconds, the barrier until the last bucket
is in its tensors).

Last line: `ratio heal_over_link_rate VALUE`: the joiner's heal bytes over its transfer seconds, against the
link's rate in bytes (`--mbit` x 10^6 / 8). What it leaves out: the TCP/IP headers the limit also counts
(~3% at a 1500-byte MTU: a perfect transfer reads ~0.97), the heal group's rendezvous (in the heal's
`seconds`, not its `transfer`), and tbf's burst (10 ms of the rate, let through at once: 1.25 MB of the
bytes at 1 Gbit/s). The two hosts share this machine's cores; the link is the kernel's veth and bridge.
Usage: sudo python benchmarks/heal_link.py [--mbit 1000] [--n-layer 4] [--n-embd 384] [--steps 24]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives with the tests

from tests.cluster.cluster_run import start  # noqa: E402
from tests.cluster.hosts import Cluster, sweep, why_not  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=int, default=1000, help="host 2's link rate, Mbit/s")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=384, help="its width: a wider model heals more bytes")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--fault-step", type=int, default=4)
    args = ap.parse_args()
    reason = why_not()
    if reason:
        raise SystemExit(reason)
    sweep()
    tmp = Path(tempfile.mkdtemp(prefix="heal-link-"))
    flags = [f"--run.steps={args.steps}", f"--model.n_layer={args.n_layer}", f"--model.n_embd={args.n_embd}",
             "--coord.heartbeat_timeout=3", f"--run.faults=kill:replica=1,step={args.fault_step},phase=compute"]
    with Cluster(3, tmp) as cluster:
        cluster.rate(2, args.mbit)
        run = start(cluster, tmp, flags, restarts=1)
        code = run.wait(600)
        events = run.events()
    heals = [e for e in events if e["event"] == "heal" and e["side"] == "joiner"]
    if code != 0 or not heals:
        raise SystemExit(f"the run {'failed' if code else 'ended'} without a heal (exit {code}; run dir {tmp})")
    h = heals[0]
    rate = args.mbit * 1e6 / 8
    bw = h["bytes"] / h["transfer"]
    print(f"host 2's link at {args.mbit} Mbit/s ({rate / 1e6:.1f} MB/s): group 1 healed {h['bytes'] / 1e6:.1f} MB "
          f"at step {h['step']} in {h['transfer']:.3f} s of transfer ({h['seconds']:.3f} s with the heal group's "
          f"rendezvous): {bw / 1e6:.1f} MB/s; run dir {tmp}")
    print(f"ratio heal_over_link_rate {bw / rate:.3f}")


if __name__ == "__main__":
    main()
