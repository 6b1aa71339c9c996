"""A stand-in trainer process for snapshot tests: saves states or restores them, as a real trainer
would through SnapshotClient. Run as `python trainer_proc.py MODE --port ... --run ...`."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torch.distributed import TCPStore  # noqa: E402

from snapstates import same, state  # noqa: E402
from unbroken.runtime.snapshot.client import SnapshotClient  # noqa: E402
from unbroken.runtime.snapshot.erasure import gloo_group  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "kill-mid-copy", "restore"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    store = TCPStore("127.0.0.1", a.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    c = SnapshotClient(store, run_id=a.run, rank=a.rank, world=a.world, shm_dir=a.shm, timeout_s=20)
    if a.mode == "save":
        for step in range(1, a.steps + 1):
            c.save(step, state(step, a.n), {"step": step})
            c.wait_committed(step)
        print(f"SAVED {a.steps}", flush=True)
        time.sleep(60)  # killed by the test
    elif a.mode == "kill-mid-copy":
        s1, s2 = state(1, a.n), state(2, a.n)
        c.save(1, s1, {"step": 1})
        c.wait_committed(1)
        c.save_async(2, s2, {"step": 2})
        print("COPYING", flush=True)  # the test SIGKILLs us the moment it reads this line
        c.wait()
        time.sleep(60)
    else:
        pg = gloo_group(store, f"restore-{a.run}", a.rank, a.world, 20)
        got = c.restore(group=pg if a.world > 1 else None)
        ok = got.step == a.steps and got.meta == {"step": a.steps} and same(got.tensors, state(a.steps, a.n))
        print(f"RESTORED {got.step} {'OK' if ok else 'MISMATCH'}", flush=True)
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
