"""Low-bit copies of linear weights for small batches (decode), on the CPU.

A decode step multiplies a handful of rows by every weight of the model, so its speed is the
speed of reading the weights from memory. When a checkpoint's tensors are already 4- or 8-bit
(GGUF), octavo keeps a copy in torch's packed int4 (groups of 32, scale and zero) or int8
(per-channel) format and uses it whenever a linear layer sees at most `MAX_ROWS` rows; larger
batches (prefill) keep the dense bf16 weights, where those kernels are slower than bf16 GEMM.
The re-quantization follows the source's own granularity, so it loses almost nothing against the
source; it is still a second code path, checked against the dense one in the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import fused

MAX_ROWS = 4  # above this, bf16 GEMM wins (measured: int4 103 µs vs bf16 139 µs at 4 rows)
GROUP = 32


class Int4Weight:
    """w ≈ q * scale + min per group of 32 inputs (q in 0..15), torch's CPU int4 layout."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        w = weight.float().reshape(n, k // GROUP, GROUP)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale  # torch computes (q - 8) * scale + zero
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.cat([scale, zero], -1).to(torch.bfloat16).transpose(0, 1) \
            .contiguous()  # [k / 32, n, 2]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_zeros": self.scales_zeros}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Int4Weight:
        self = cls.__new__(cls)
        self.packed, self.scales_zeros = t["packed"], t["scales_zeros"]
        return self


class Int8Weight:
    """w ≈ q * scale per output channel (q in -127..127)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-10)
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale  # float32, for octavo's kernel
        self.scale_bf16 = scale.to(torch.bfloat16)  # for torch's

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # octavo's AVX-512 kernel reads the weights at close to memory speed; torch's int8
        # kernel took 2.4x longer for the 49152 x 576 LM head at one row.
        if fused.native_active(x):
            return fused.int8_gemv(x, self.q, self.scale)
        return torch._weight_int8pack_mm(x, self.q, self.scale_bf16)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "scale": self.scale}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Int8Weight:
        self = cls.__new__(cls)
        self.q, self.scale = t["q"], t["scale"]
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        return self


DECODE_KINDS = {"int4": Int4Weight, "int8": Int8Weight}


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] % GROUP == 0)


def make_decode_weight(weight: torch.Tensor, bits: int) -> Int4Weight | Int8Weight | None:
    """The low-bit copy for a tensor whose source had `bits` bits per weight, if one helps."""
    if not supported(weight) or bits > 8:
        return None
    return Int4Weight(weight) if bits <= 4 else Int8Weight(weight)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       decode: Int4Weight | Int8Weight | None) -> torch.Tensor:
    if decode is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16:
        y = decode.matmul(x)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
