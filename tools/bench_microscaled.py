"""Time octavo's microscaled GEMV (csrc/microscaled.h): a few rows of x times random MXFP4
weights (e2m1 codes with e8m0 scales per 32 inputs) or FP8 ones (e4m3 bytes with a float32
scale per row, as FP8 checkpoints have them), the weights rotated so that each call reads them
from DRAM, as a decode step does. Prints the median time a call and a row of x, and the
rate the codes are read at, for each row count. Usage:

    python3 -m tools.bench_microscaled [--format mxfp4|fp8] [--size 2880] [--rows 1,2,4,8,16]
        [--dtype bfloat16]

Run an older build side by side from a worktree (`git worktree add /tmp/old <commit>`, then
`cd /tmp/old && PYTHONPATH=/tmp/old python3 -m tools.bench_microscaled`), alternating.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from octavo.kernels import fused
from octavo.model.quant.microscaled import FP4_VALUES, e4m3_table, e8m0_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="mxfp4", choices=["mxfp4", "fp8"])
    parser.add_argument("--size", type=int, default=2880, help="N = K (gpt-oss's hidden size)")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--weights", type=int, default=20, help="weights rotated per timing")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fused.enable_native("on")
    kernels = fused.native_module()
    n = k = args.size
    if args.format == "mxfp4":
        table, scale_table, block = torch.tensor(FP4_VALUES), e8m0_table(), 32
        weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                    torch.randint(120, 131, (n, k // 32), dtype=torch.uint8))
                   for _ in range(args.weights)]
    else:
        table, scale_table, block = e4m3_table(), torch.empty(0), k
        weights = [(torch.randint(0, 0x7F, (n, k), dtype=torch.uint8),
                    torch.rand(n, 1) * 0.01) for _ in range(args.weights)]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k).to(getattr(torch, args.dtype))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for codes, scales in weights:
                kernels.microscaled_gemv(x, codes, scales, table, scale_table, block)
            times.append((time.perf_counter() - start) / len(weights))
        t = statistics.median(times)
        rate = sum(w.numel() * w.element_size() for w in weights[0]) / t / 1e9
        print(f"rows {rows:2d}: {t * 1e6:8.1f} us a call, {t * 1e6 / rows:7.1f} us a row, "
              f"codes read at {rate:5.1f} GB/s")


if __name__ == "__main__":
    main()
