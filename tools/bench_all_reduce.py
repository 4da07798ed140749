"""Micro-benchmark (not a test): gloo's all-reduce against the shared-memory one
(octavo/distributed/shm_all_reduce.py) between two ranks pinned to one core each.

    python3 -m tools.bench_all_reduce [values=576] [iterations=2000]
"""
from __future__ import annotations

import os
import sys
import time

from tools.pinned_ranks import run_two


def _rank(rank: int, init: str, n: int, iters: int, results) -> None:
    import torch
    import torch.distributed as dist

    from octavo.distributed import shm_all_reduce

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    shm = shm_all_reduce.open_for_group(None, [0, 1], rank)
    x = torch.randn(n).to(torch.bfloat16)
    out = {}
    for name, reduce in (("gloo", dist.all_reduce), ("shared memory", shm.all_reduce)):
        for _ in range(100):  # warm up
            reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            reduce(x)
        out[name] = (time.perf_counter() - start) / iters * 1e6
    results.put((rank, out))
    shm.close()
    dist.destroy_process_group()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 576
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    got = run_two(_rank, n, iters, timeout_s=300)
    print(f"{n} bf16 values, 2 pinned ranks, mean of {iters}: " + ", ".join(
        f"{name} {us:.1f} us" for name, us in got.items()))


if __name__ == "__main__":
    main()
