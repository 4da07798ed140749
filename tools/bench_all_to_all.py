"""Micro-benchmark (not a test): one MoE layer under expert parallelism across two
context-parallel ranks (rows dispatched to their experts' ranks and back, moe.FusedMoE._dispatched)
against its all-to-alls alone, two ranks pinned to one core each, gloo.

    python3 -m tools.bench_all_to_all [tokens per rank=256] [hidden=1024] [iterations=200]

The layer: 16 experts of width 512, top 4, float32, random weights and tokens.
"""
from __future__ import annotations

import os
import sys
import time

from tools.pinned_ranks import run_two

EXPERTS, TOP_K, WIDTH = 16, 4, 512


def _rank(rank: int, init: str, tokens: int, hidden: int, iters: int, results) -> None:
    import torch

    from octavo.distributed import parallel_state
    from octavo.distributed.parallel_state import RankPlacement
    from octavo.model.layers.moe import FusedMoE

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    torch.set_num_threads(1)
    parallel_state.init(RankPlacement(rank, expert_parallel=True, cp_size=2), init)
    torch.manual_seed(rank)
    moe = FusedMoE(EXPERTS, TOP_K, hidden, WIDTH, "silu", True)
    torch.nn.init.normal_(moe.w13, std=0.05)
    torch.nn.init.normal_(moe.w2, std=0.05)
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, EXPERTS)
    rows = tokens * TOP_K // 2  # what a rank sends each rank, routing being even on average
    send = [rows, rows]

    def layer() -> None:
        moe(x, logits)

    def exchanges() -> None:
        (back, _), recv, matrix = parallel_state.ep_all_to_all(
            [x.new_empty(rows * 2, hidden), torch.zeros(rows * 2, dtype=torch.long)], send)
        parallel_state.ep_all_to_all([back], recv, matrix.t())

    out = {}
    for name, run in (("MoE layer", layer), ("its all-to-alls alone", exchanges)):
        for _ in range(10):  # warm up
            run()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        out[name] = (time.perf_counter() - start) / iters * 1e3
    results.put((rank, out))
    parallel_state.destroy()


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    got = run_two(_rank, tokens, hidden, iters)
    print(f"{tokens} tokens per rank, hidden {hidden}, {EXPERTS} experts top {TOP_K}, "
          f"2 pinned ranks, mean of {iters}: " + ", ".join(
              f"{name} {ms:.3f} ms" for name, ms in got.items()))


if __name__ == "__main__":
    main()
