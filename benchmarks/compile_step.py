"""Step time of a torch.compile'd run (model.compile, inductor per block) against the same run in eager, side
by side on this host: one run of unbroken's launcher per mode, alternated round by round.

Prints each run's median step time over its steps after the first `--skip` (the compiles happen in the first
step's forward and backward, and again where a shape changes) and the ratio compiled / eager (below 1: the
compiled run steps faster). What it leaves out: the compile time itself (printed apart, as the first step's
excess over the median), the GPU (this host has none: inductor's C++/OpenMP CPU kernels here), and
multi-process layouts (one replica of one rank).

    python benchmarks/compile_step.py [--rounds 1] [--steps 24] [--backend inductor]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _alternate import alternate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--skip", type=int, default=4, help="first steps left out of the median (compiling)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    a = ap.parse_args()
    base = dict(replicas=1, steps=a.steps, microbatches=4, exact=False, progress=False, model__arch="llama",
                model__n_embd=a.n_embd, model__n_layer=a.n_layer, model__n_head=4, model__block_size=128,
                data__seq_len="128", data__batch_size=8, data__max_files=60, parallel__device="cpu",
                coord__run_timeout=1800.0, coord__startup_timeout=900.0, coord__progress_timeout=900.0)
    modes = {"eager": {}, "compiled": dict(model__compile=True, model__compile_backend=a.backend)}

    def measure(events: list[dict]) -> dict:
        times = [r["step_time"] for r in sorted((e for e in events if e["event"] == "step"), key=lambda r: r["step"])]
        return {"median": statistics.median(times[a.skip:]), "first": times[0]}

    got = alternate(a.rounds, modes, base, "compile step", measure,
                    lambda rnd, mode, m: f"round {rnd} {mode:8s} median step {m['median'] * 1e3:7.1f} ms, "
                                         f"first step {m['first']:.2f} s")
    eager = statistics.median(m["median"] for m in got["eager"])
    compiled = statistics.median(m["median"] for m in got["compiled"])
    compile_s = statistics.median(m["first"] - m["median"] for m in got["compiled"])
    print(f"compiled ({a.backend}) / eager step time: {compiled / eager:.3f} ({compiled * 1e3:.1f} ms vs "
          f"{eager * 1e3:.1f} ms, median of {a.rounds} round(s)); the compile itself: ~{compile_s:.0f} s in the "
          f"first step, left out")


if __name__ == "__main__":
    main()
