"""Low-bit copies of weights for small batches (decode), on the CPU.

A decode step multiplies a handful of rows by every weight of the model, so its speed is the
speed of reading the weights from memory. When a GGUF's tensors are 4- or 8-bit, octavo keeps,
beside the dense bf16 weight, a packed int4 (groups of 32, scale and minimum) or int8
(groups of 32, a scale each) copy and uses it whenever the layer sees at most `MAX_ROWS` rows; larger batches
(prefill) keep the dense bf16 weights, where those kernels are slower than bf16 GEMM. A linear
layer's copy is built from the GGUF's own codes where the layouts match (quant/gguf.py); the LM
head's copy here, from its dense weight at the source's granularity.
"""
from __future__ import annotations

import torch

from octavo.kernels import onednn
from octavo.model.quant.packed import PackedWeight, quantize_int4, quantize_int8_grouped

MAX_ROWS = 4  # above this, bf16 GEMM wins (measured: int4 103 µs vs bf16 139 µs at 4 rows)
GROUP = 32


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
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


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       decode: PackedWeight | None) -> torch.Tensor:
    if decode is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16:
        y = decode.matmul(x)
        return y if bias is None else y + bias
    return onednn.linear(x, weight, bias)
