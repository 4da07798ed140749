"""Dense bf16 weights packed once into oneDNN's GEMM layout, on the CPU.

`F.linear` on a plain [N, K] bf16 weight makes oneDNN reorder the weight into its blocked
layout on every call: a pass over the weight in memory before the multiply. Packing it once at
load removes that pass. The products are the same oneDNN kernels, so the results are bit for bit
those of `F.linear` (tests/kernels/test_onednn.py); only the time changes. Measured on this
project's 2-core AVX-512-BF16 machine, SmolLM2-135M's 121 linear layers with cold weights, per
step: 31.3 → 16.1 ms at 12 rows, 73.4 → 55.0 ms at 64, 1,561 → 1,439 ms at 2,048.

A packed weight is an opaque (mkldnn-layout) tensor: it keeps shape and dtype, but has no
strides or storage; `dense()` gives the plain tensor back (exactly) where one is needed.
float32 weights stay plain: their packed GEMM is faster too but sums in another order than
`F.linear`'s MKL path, so outputs would no longer match the unpacked layers bit for bit.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The row count oneDNN picks its weight layout for; every row count computes correctly with
# it, and 1..2,048 rows measured within a few percent of each other's best layout.
LAYOUT_ROWS = 64


def packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and not weight.is_mkldnn and bf16_packing_available())


@functools.cache
def bf16_packing_available() -> bool:
    """Whether this torch and CPU pack bf16 weights: oneDNN's bf16 reorder needs AVX-512BW/VL/DQ
    or AVX-NE-CONVERT, and raises elsewhere (an AMD EPYC with AVX2 only), where bf16 weights
    stay plain for F.linear."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        pack(torch.zeros(16, 32, dtype=torch.bfloat16))
    except RuntimeError as exc:
        logger.info("bf16 weights stay unpacked: %s", str(exc).splitlines()[0])
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the same weight in oneDNN's layout (see `packable`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), LAYOUT_ROWS)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] tensor of a weight, packed or not."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a packed or plain weight; x [..., K] -> [..., N]."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if x.dtype != weight.dtype:
        raise TypeError(f"a packed {weight.dtype} weight needs {weight.dtype} activations, "
                        f"got {x.dtype}")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
