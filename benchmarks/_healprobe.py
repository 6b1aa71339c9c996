"""The link under a heal, measured in the same run: installed into each worker by benchmarks/rejoin.py.

Owns: wrapping the trainer's heal calls (donor.donate, admission.receive) so that right after a heal's
transfer the same two processes send the same number of bytes once more as one plain torch.distributed
send/recv over the same gloo group (after a barrier, as the heal's transfer is timed), and writing each
side's (bytes, seconds) to DIR/probe-<pid>.jsonl. Does not own: the heal (persist/healing.py) or the
figures (rejoin.py). Not part of unbroken: a run without this module on its path has no probe in it.

The donor's step is held up by the probe too (one more transfer of the state): rejoin.py says so.
"""
from __future__ import annotations

import json
import os
import time


def _probe(pg, nbytes: int, rank: int, path: str) -> None:
    import torch
    buf = torch.empty(nbytes // 4)
    pg.barrier().wait()
    t = time.perf_counter()
    (pg.send([buf], 1, 0) if rank == 0 else pg.recv([buf], 0, 0)).wait()
    with open(path, "a") as f:
        f.write(json.dumps({"side": "donor" if rank == 0 else "joiner", "bytes": nbytes,
                            "seconds": time.perf_counter() - t}) + "\n")


def install(out_dir: str) -> None:
    """Call once at start-up (sitecustomize). In a trainer worker: wrap the heal calls."""
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    worker = any(a.startswith(b"unbroken.runtime.trainer") for a in argv)  # -m unbroken.runtime.trainer[.lifecycle]
    if not worker or b"torch.distributed.run" in argv:  # a worker, not its agent
        return
    from unbroken.runtime.trainer import admission, donor

    path = os.path.join(out_dir, f"probe-{os.getpid()}.jsonl")
    donate, receive = donor.donate, admission.receive

    def probed_donate(forming, *args, **kwargs):
        sent = donate(forming, *args, **kwargs)
        _probe(forming.get(), sent[0], 0, path)
        return sent

    def probed_receive(forming, *args, **kwargs):
        got = receive(forming, *args, **kwargs)
        _probe(forming.get(), got[0], 1, path)
        return got

    donor.donate, admission.receive = probed_donate, probed_receive
