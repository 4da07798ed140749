"""Packed weights' products with activations quantized to int8 (csrc/int4_int8_gemm.h, and
int4_int8_avx2.h without AVX-512 VNNI): the kernel against the same arithmetic in float64 (at
the rows that stream the codes and at those that unpack each row block once), its error against
the exact product, and where octavo uses it: bf16 batches past the int4 kernel's rows on CPUs
with AVX-512 VNNI and without AMX, and float32 ones on CPUs without native bf16 (where float32
is `auto`'s dtype), both only in `--dtype auto`'s plan (an explicit dtype computes exactly);
float32 stays exact where bf16 is native; decode's rows never take int8 (the int16 product,
also here, takes float32 ones where bf16 is not native)."""
from __future__ import annotations

import logging

import pytest
import torch

from octavo.model.quant.packed import Int4Packed


def _needs_kernel(dtype: torch.dtype = torch.bfloat16) -> None:
    """After the native_kernels fixture: skip where the kernel of `dtype` is not built."""
    from octavo.kernels import fused

    if dtype == torch.bfloat16 and not fused._native.has_int4_int8_gemm:
        pytest.skip("the int8-activation GEMM with bf16 activations needs AVX-512 VNNI")
    if dtype == torch.float32 and not fused._native.has_int4_int8_gemm_f32:
        pytest.skip("the int8-activation GEMM with float32 activations needs AVX2")


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
@pytest.mark.parametrize("rows", [6, 37])
def test_kernel_computes_the_quantized_product(native_kernels, bits, half, dtype, rows):
    from octavo.kernels import fused

    _needs_kernel(dtype)
    n, k = 100, 320  # N padded to 112; 37 rows: past passes of 8 and a partial one
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


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_decode_rows_stream_the_codes(native_kernels, bits, rows):
    """A few rows of float32 x (decode: the AVX2 kernel unpacks the codes as they stream) give
    the quantized product, the 8-bit codes' signed form included."""
    from octavo.kernels import fused

    _needs_kernel(torch.float32)
    n, k = 48, 256
    packed, w = _weights(n, k, bits, True, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(bits))
    y = fused.int4_int8_gemm(x, *packed.native_layout())[:, :n].double()
    ref = _quantized(x) @ w.t()
    assert ((y - ref).abs() <= 2e-6 * ref.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("rows", [3, 37])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_codes_and_inputs_do_not_overflow_the_words(native_kernels, bits, rows, sign):
    """The AVX2 kernel adds a group's 4-bit products over eight quads (5-bit: four) in 16-bit
    words before widening them: with every code at its largest and every input quantized to
    +-127, a word reaches 30,480 (31,496). A longer span would wrap and fail this; 37 rows take
    the unpacked blocks in passes of 4 (5-bit: 2) and a partial one, 3 rows the streaming path."""
    from octavo.kernels import fused

    _needs_kernel(torch.float32)
    n, k = 32, 128
    q = torch.full((n, k), (1 << bits) - 1, dtype=torch.uint8)
    scale = torch.full((n, k // 32), 0.01)
    low = torch.zeros(n, k // 32)
    packed = Int4Packed.from_affine(q, scale, low, 32, torch.bfloat16, bits)
    w = scale.repeat_interleave(32, 1).double() * q.double()
    x = torch.full((rows, k), sign)
    y = fused.int4_int8_gemm(x, *packed.native_layout())[:, :n].double()
    ref = _quantized(x) @ w.t()
    assert ((y - ref).abs() <= 2e-6 * ref.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("native_bf16", [True, False])
def test_where_octavo_takes_it(native_kernels, monkeypatch, native_bf16):
    """Batches past the int4 kernel's rows: bf16 ones (not on AMX), float32 ones on a CPU
    without native bf16 only (where bf16 is native, float32 is asked for: exact); decode's rows
    never."""
    from octavo.kernels import fused
    from octavo.platform import CpuPlatform, cpu_platform

    flags = set(cpu_platform().flags) - {"avx512_bf16", "amx_bf16", "amx_tile"}
    if native_bf16:
        flags |= {"avx512_bf16"}
    platform = CpuPlatform(frozenset(flags))
    monkeypatch.setattr(fused, "cpu_platform", lambda: platform)
    packed, w = _weights(64, 256, 4, True)
    assert not packed.quantized_activations  # until the load allows it (dtype auto)
    packed.quantized_activations = True
    calls = []
    real = fused.int4_int8_gemm
    monkeypatch.setattr(fused, "int4_int8_gemm", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    if fused._native.has_int4_int8_gemm:
        packed.dtype = torch.bfloat16
        small = torch.randn(packed.dense_rows, 256, generator=gen)
        large = torch.randn(packed.dense_rows + 9, 256, generator=gen)
        packed.matmul(small.bfloat16())
        assert not calls  # the int4 kernel's rows
        y = packed.matmul(large.bfloat16())
        assert calls == [1]
        exact = large.bfloat16().double() @ w.t()
        assert (y.double() - exact).norm() / exact.norm() < 0.01
        calls.clear()
    if not fused._native.has_int4_int8_gemm_f32:
        pytest.skip("no int8-activation GEMM for float32 in this build")
    packed.dtype = torch.float32
    # Where bf16 is native, float32's panel takes every batch (fused.panel_ready): no crossover.
    limit = min(packed.dense_rows, 64)
    for rows in (1, limit, limit + 9):
        x = torch.randn(rows, 256, generator=gen)
        y32 = packed.matmul(x)
        exact = x.double() @ w.t()
        if native_bf16 or rows <= packed.dense_rows:  # exact, or int16 activations: 2e-5
            torch.testing.assert_close(y32.double(), exact, rtol=1e-4, atol=1e-4)
        else:
            assert (y32.double() - exact).norm() / exact.norm() < 0.01
    assert calls == ([] if native_bf16 else [1])


def test_only_dtype_auto_allows_it(native_kernels, smollm_gguf, caplog):
    """A GGUF loaded with dtype auto lets its packed weights take int8 (and int16) activations
    where this CPU has the kernels, and the log says so; an explicit dtype keeps every product
    exact."""
    from octavo import LLM
    from octavo.kernels import fused
    from octavo.model.quant.weights import PackedWeights

    for dtype in ("auto", "float32"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="octavo.worker.worker"):
            llm = LLM(str(smollm_gguf), dtype=dtype, max_model_len=64,
                      kv_cache_memory=8 << 20)
        model = llm.engine.client.core.executor.worker.runner.model
        packed = [m.weights.packed for m in model.modules()
                  if isinstance(getattr(m, "weights", None), PackedWeights)]
        assert packed
        expected = dtype == "auto"
        assert all(p.quantized_activations == expected for p in packed)
        ready = any(p.int8_product_ready(p.dtype) for p in packed)
        assert ready == (expected and fused.int4_int8_gemm_ready(packed[0].dtype))
        int16 = fused.int4_int16_gemm_ready(packed[0].dtype)
        assert all(p.int16_product_ready(p.dtype) == (expected and int16) for p in packed)
        plan = [r.getMessage() for r in caplog.records if "quantized to" in r.getMessage()]
        assert len(plan) == (1 if expected and (ready or int16) else 0)
        assert all(("int16" in m) == int16 and ("int8" in m) == ready for m in plan)
        del llm


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 12, 67])
def test_int16_kernel_computes_its_quantized_product(native_kernels, bits, half, rows):
    """int4_int16_gemm (csrc/int4_int16_avx2.h): float32 x rounded to int16 per row and 32
    inputs, q = round(x * 32767 / max |x|), times the codes; about 2e-5 of the exact product.
    Up to 4 rows the codes are widened as they stream; past that each row block once, for
    every 4 rows and the 1 to 3 left over."""
    from octavo.kernels import fused

    if not fused._native.has_int4_int16_gemm:
        pytest.skip("the int16-activation kernel needs AVX2")
    n, k = 40, 256  # a tail row block
    packed, w = _weights(n, k, bits, half, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(bits))
    x[0, :32] = 0  # a zero group: d = 0
    y = fused.int4_int16_gemm(x, *packed.native_layout())[:, :n].double()
    g = x.view(rows, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax.double(), 0).float()
    xq = ((g * inv).round() * (amax.double() / 32767).float()).view(rows, k).double()
    exact = x.double() @ w.t()
    ref = xq @ w.t()
    assert ((y - ref).abs() <= 2e-6 * ref.abs().amax(1, keepdim=True)).all()
    assert (y - exact).norm() / exact.norm() < 1e-4
    with pytest.raises(RuntimeError, match="float32"):
        fused.int4_int16_gemm(x.bfloat16(), *packed.native_layout())
