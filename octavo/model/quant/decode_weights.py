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

import torch

from octavo.kernels import fused, onednn
from octavo.model.quant.packed import (
    INT4_ROWS,
    INT4_ROWS_AMX,
    INT4_ROWS_F32,
    INT8_ROWS_F32,
    Int4Packed,
    Int8Grouped,
    PackedWeight,
    int4_rows,
    quantize_int4,
    quantize_int8_grouped,
)

__all__ = ["INT4_ROWS", "INT4_ROWS_AMX", "INT4_ROWS_F32", "INT8_ROWS_F32", "MAX_ROWS",
           "make_decode_weight", "max_rows", "supported"]

MAX_ROWS = 4
GROUP = 32


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
        return int4_rows(decode.dtype, decode.bits)
    if isinstance(decode, Int8Grouped) and decode.dtype == torch.float32 and fused.native_ready():
        return INT8_ROWS_F32
    return MAX_ROWS

