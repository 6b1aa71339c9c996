"""Erasure-coding bandwidth over memcpy: XOR parity (k+1, numpy) and Reed-Solomon 4+2 (pyeclib).

Data: --size-gb bytes split into k = 4 blocks. Figures are GB/s of protected data; memcpy is torch's
copy_ of the same bytes into pre-faulted memory. Single process: the cross-node transport (gloo)
is not included. "xor encode (torch ref)" is the earlier whole-block torch bitwise_xor_, for
comparison with the cache-blocked numpy encode now in erasure.xor_encode. Usage: python benchmarks/erasure.py [--size-gb 1.2] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from unbroken.runtime.snapshot.erasure import RSCodec, xor_decode, xor_encode


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _xor_torch(blocks):
    acc = blocks[0].clone()
    w = acc.view(torch.int64)
    for b in blocks[1:]:
        w.bitwise_xor_(b.view(torch.int64))
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.2)
    p.add_argument("--quick", action="store_true", help="64 MB of data")
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    k = 4
    c = int((0.064 if a.quick else a.size_gb) * 1e9) // k // 4096 * 4096
    gb = k * c / 1e9
    blocks = [torch.randint(0, 256, (c,), dtype=torch.uint8) for _ in range(k)]
    src = torch.cat(blocks)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t_mem = best(lambda: dst.copy_(src), a.reps)
    parity = xor_encode(blocks)
    t_xe = best(lambda: xor_encode(blocks), a.reps)
    t_xt = best(lambda: _xor_torch(blocks), a.reps)
    assert torch.equal(_xor_torch(blocks), parity)
    t_xd = best(lambda: xor_decode(parity, blocks[1:]), a.reps)
    assert torch.equal(xor_decode(parity, blocks[1:]), blocks[0])
    rs = RSCodec(k, 2)
    par = rs.encode(blocks)
    t_re = best(lambda: rs.encode(blocks), a.reps)
    have = {2: blocks[2], 3: blocks[3], 4: par[0], 5: par[1]}
    t_rd = best(lambda: rs.reconstruct(have, [0, 1]), a.reps)
    got = rs.reconstruct(have, [0, 1])
    assert torch.equal(got[0], blocks[0]) and torch.equal(got[1], blocks[1])
    print(f"{gb:.3f} GB protected, k={k}, torch threads {torch.get_num_threads()}, RS backend {rs.backend}")
    for name, t in [("memcpy", t_mem), ("xor encode", t_xe), ("xor encode (torch ref)", t_xt), ("xor rebuild 1 lost", t_xd),
                    ("rs 4+2 encode", t_re), ("rs 4+2 rebuild 2 lost", t_rd)]:
        print(f"{name:22s} {t:.3f} s  {gb / t:6.2f} GB/s")
    print(f"ratio xor_encode_numpy_over_torch_ref {t_xt / t_xe:.2f}")
    print(f"ratio xor_encode_over_memcpy {t_mem / t_xe:.2f}")
    print(f"ratio xor_rebuild_over_memcpy {t_mem / t_xd:.2f}")
    print(f"ratio rs42_rebuild_over_memcpy {t_mem / t_rd:.2f}")
    print(f"ratio rs42_encode_over_memcpy {t_mem / t_re:.2f}")


if __name__ == "__main__":
    main()
