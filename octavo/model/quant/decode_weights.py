"""Low-bit copies of weights for small batches (decode), on the CPU.

A decode step multiplies a handful of rows by every weight of the model, so its speed is the
speed of reading the weights from memory. When a GGUF's tensors are 4- or 8-bit, octavo keeps,
beside the dense bf16 weight, a packed int4 (groups of 32, scale and minimum) or int8
(groups of 32, a scale each) copy and uses it whenever the layer sees at most `max_rows` rows
(`DenseWeights`' small-batch copy, quant/weights.py);
larger batches (prefill) keep the dense bf16 weights, where those kernels are slower than bf16
GEMM. A linear layer's copy is built from the GGUF's own codes where the layouts match
(quant/gguf.py); the LM head's copy here, from its dense weight at the source's granularity.
"""
from __future__ import annotations

import functools

import torch

from octavo.kernels import fused, onednn
from octavo.model.quant.packed import (Int4Packed, Int8Grouped, PackedWeight, quantize_int4,
                                       quantize_int8_grouped)

# The most rows a low-bit copy takes before the (oneDNN-packed) bf16 GEMM wins. octavo's int4
# kernel reads 4-bit codes at memory speed and reuses each unpacked code for every row: for
# SmolLM2's linear layers (cold weights, 2 threads) 2.6 ms at 1 row against torch's int4
# kernel's 3.8 and bf16's 13.0; 11.9 vs 16.5 ms at 16 rows, 22.6 vs 26.1 at 32, 35.7 vs 37.9 at
# 48, 45.4 vs 46.9 at 64 (where both are bound by the multiplies). torch's int4 kernel and the
# int8 GEMV stop winning at about 4 rows (the LM head in int8: 1.95 vs 2.19 ms at 4 rows, 3.9
# vs 2.8 at 8).
INT4_ROWS = 64
# With AMX, oneDNN's bf16 GEMM runs on the tile units and costs little more than reading its
# weights well past 64 rows, so the int4 copy wins only for a few. Intel Xeon with AMX (KVM,
# 2 threads), the same layers: int4 11.3 vs bf16 15.0 ms at 8 rows, 16.1 vs 14.9 at 12, 39.5 vs
# 17.4 at 32, 78.3 vs 20.7 at 64. (The int8 LM head's crossover stays at 4 rows: 2.06 vs 2.08 ms.)
INT4_ROWS_AMX = 10
# With float32 activations (CPUs without AVX-512-BF16; csrc/quant_gemv.h, int4_block_f32) the kernel
# stays ahead of the float32 GEMM far longer: on an AMD EPYC with AVX2 only (2 threads), the
# same layers took 3.1 ms at 1 row against 31.2, 46.5 vs 78.5 at 32, 93.5 vs 120.1 at 64, 187.1
# vs 206.1 at 128 and 393.3 vs 373.4 at 256. The int8 LM head there: 1.8 vs 9.4 ms at 1 row,
# 22.8 vs 37.7 at 32, 45.1 vs 43.2 at 64.
INT4_ROWS_F32 = 128
INT8_ROWS_F32 = 32
MAX_ROWS = 4
GROUP = 32


@functools.cache
def _bf16_gemm_on_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def int4_rows(dtype: torch.dtype) -> int:
    """The most rows octavo's int4 kernel takes, with activations of `dtype`, before the dense
    GEMM wins on this CPU."""
    if dtype == torch.float32:
        return INT4_ROWS_F32
    return INT4_ROWS_AMX if _bf16_gemm_on_amx() else INT4_ROWS


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and weight.dim() == 2 and weight.shape[1] % GROUP == 0)


def make_decode_weight(weight: torch.Tensor, bits: int) -> PackedWeight | None:
    """The low-bit copy of a weight whose source had `bits` bits per weight, if one helps:
    int4 min/max per 32 inputs for 4 bits or fewer, int8 absmax per 32 up to 8 (Q8_0's rule,
    so a Q8_0 source comes back code for code)."""
    weight = onednn.dense(weight)
    if not supported(weight) or bits > 8:
        return None
    if bits <= 4:
        return quantize_int4(weight, GROUP, weight.dtype)
    return quantize_int8_grouped(weight, GROUP, weight.dtype)


def max_rows(decode: PackedWeight) -> int:
    """The most rows `decode` (a dense layer's low-bit copy) computes (see int4_rows)."""
    if isinstance(decode, Int4Packed) and fused.int4_gemm_ready(decode.dtype):
        return int4_rows(decode.dtype)
    if isinstance(decode, Int8Grouped) and decode.dtype == torch.float32 and fused.native_ready():
        return INT8_ROWS_F32
    return MAX_ROWS

