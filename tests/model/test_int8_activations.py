"""Packed weights' large batches with activations quantized to int8 (csrc/int4_int8_gemm.h):
the kernel against the same arithmetic in float64, its error against the exact product, and
where octavo uses it (bf16 batches past the int4 kernel's rows, on CPUs with AVX-512 VNNI and
without AMX; float32 stays exact)."""
from __future__ import annotations

import pytest
import torch

from octavo.model.quant.packed import Int4Packed


def _needs_kernel() -> None:
    """After the native_kernels fixture: skip where the kernel is not built."""
    from octavo.kernels import fused

    if not fused._native.has_int4_int8_gemm:
        pytest.skip("the int8-activation GEMM needs AVX-512 VNNI")


def _weights(n, k, bits, half, seed=0):
    """Codes of `bits` bits with a scale and an offset per 32 inputs: w = scale * q + low."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    low = -scale * (1 << (bits - 1)) + torch.randn(n, k // 32, generator=g) * 1e-3
    if half:  # a GGUF's float16 scale and low (else float32 scale and zero)
        scale, low = scale.half().float(), low.half().float()
    packed = Int4Packed.from_affine(q, scale, low, 32, torch.bfloat16, bits)
    w = (scale.repeat_interleave(32, 1) * q.double() + low.repeat_interleave(32, 1)).double()
    return packed, w


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: q = round(x * 127 / max |x|) per row and 32 inputs,
    times max |x| / 127 (float32 operations, each correctly rounded: torch may divide by a
    reciprocal, whose last bit can move a product across a rounding tie)."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.double(), 0).float()
    q = (g * inv).round()
    return (q * (amax.double() / 127).float()).view(m, k).double()


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_computes_the_quantized_product(native_kernels, bits, half, dtype):
    from octavo.kernels import fused

    _needs_kernel()
    n, k, rows = 100, 320, 37  # rows past a pass of 8 and a partial one; N padded to 112
    packed, w = _weights(n, k, bits, half, seed=bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(bits)).to(dtype)
    x[3] = 0  # a zero row: d = 0, q = 0
    x[5, 32:64] = 0  # and a zero group
    y = fused.int4_int8_gemm(x, *packed.native_layout())[:, :n].double()
    ref = _quantized(x) @ w.t()
    assert y.dtype == torch.float64 and not y[3].any()
    # float32: the same arithmetic to float32 rounding; bf16: the output's rounding on top
    # (half an ulp: at most 2^-8 of the value)
    row_max = ref.abs().amax(1, keepdim=True)
    bound = 2e-6 * row_max + (0 if dtype == torch.float32 else 2 ** -8 * ref.abs())
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() - bound).max()
    # The activations' rounding alone: about 0.55% of a Gaussian row's product.
    exact = x.double() @ w.t()
    assert (y - exact).norm() / exact.norm() < 0.008


def test_bf16_large_batches_take_it_and_float32_stays_exact(native_kernels, monkeypatch):
    from octavo.kernels import fused
    from octavo.platform import cpu_platform

    _needs_kernel()
    packed, w = _weights(64, 256, 4, True)
    calls = []
    real = fused.int4_int8_gemm
    monkeypatch.setattr(fused, "int4_int8_gemm", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(packed.dense_rows, 256, generator=gen)
    large = torch.randn(packed.dense_rows + 9, 256, generator=gen)
    packed.matmul(small.bfloat16())
    assert not calls  # the int4 kernel's rows
    y = packed.matmul(large.bfloat16())
    assert calls == ([] if cpu_platform().amx else [1])  # AMX: bf16 tiles on its tile units
    exact = large.bfloat16().double() @ w.t()
    assert (y.double() - exact).norm() / exact.norm() < 0.01
    packed.dtype = torch.float32  # float32 activations: exact tiles, never int8
    large = torch.randn(packed.dense_rows + 9, 256, generator=gen)
    y32 = packed.matmul(large)
    assert calls == ([] if cpu_platform().amx else [1])
    torch.testing.assert_close(y32.double(), large.double() @ w.t(), rtol=1e-4, atol=1e-4)
