"""Packed int4/int8 weights against dequantize-then-matmul references, across shapes, group
sizes, zero points, act-order permutations, the packed kernels and the dense-tile path."""
from __future__ import annotations

import pytest
import torch

from octavo.kernels import fused
from octavo.model.quant.gptq import unpack_cols, unpack_rows
from octavo.model.quant.packed import Int4Packed, Int8Packed, quantize_int4, quantize_int8

DENSE_ROWS = 300  # past every int4 crossover (Int4Packed.dense_rows: at most 256)


def _reference(q, scale, zero, group, perm=None):
    """w [N, K] = scale * (q - zero) per group of inputs, in the original input order."""
    s, z = scale.repeat_interleave(group, 1), zero.repeat_interleave(group, 1)
    w = s * (q.float() - z)
    if perm is not None:  # columns are in sorted order: put them back
        out = torch.empty_like(w)
        out[:, perm] = w
        w = out
    return w


def _codes(n, k, group, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    return q, scale, zero


@pytest.mark.parametrize("rows", [1, 3, DENSE_ROWS + 5])
@pytest.mark.parametrize("n,k,group", [(96, 128, 32), (200, 256, 64), (64, 384, 128),
                                       (130, 256, 256), (160, 192, 64)])
def test_int4_matches_reference(n, k, group, rows):
    q, scale, zero = _codes(n, k, group, 4)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)) if n == 160 else None
    if perm is not None:  # act-order: input perm[j] belongs to group j // group
        q = q[:, perm]
    packed = Int4Packed(q, scale, zero, group, torch.float32, perm)
    x = torch.randn(rows, k)
    ref = x @ _reference(q, scale, zero, group, perm).t()
    out = packed.matmul(x)
    assert out.shape == (rows, n)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_int4_codes_round_trip_through_torch_layout():
    for n in (64, 128, 80, 112, 48):
        q, scale, zero = _codes(n, 96, 32, 4, seed=n)
        packed = Int4Packed(q, scale, zero, 32, torch.float32)
        assert torch.equal(packed.codes(0, n).long(), q)
        assert torch.equal(packed.codes(64, n).long(), q[64:]) if n > 64 else True


@pytest.mark.parametrize("rows", [1, 5, 8, 17, 64])
def test_int4_float16_scales_give_the_float32_products_bit_for_bit(native_kernels, rows):
    """Affine scales and minimums that float16 holds exactly (a GGUF's Q4_0/Q4_1) are stored in
    float16, half the bytes; the kernel makes the zero from them as the packing does in
    float32, so products and dequantized weights are the same bit for bit. Others stay float32."""
    from octavo.kernels import fused

    if not fused.int4_gemm_ready(torch.bfloat16):
        pytest.skip("octavo's int4 kernel takes bf16 activations only with AVX-512-BF16")
    n, k = 100, 256
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    half = Int4Packed.from_affine(q, scale, low, 32, torch.bfloat16)
    full = Int4Packed.__new__(Int4Packed)
    full._pack(q, scale, 8 * scale + low, 32, torch.bfloat16, None)  # the float32 layout
    assert half.native_scales.dtype == torch.float16 and full.native_scales.dtype == torch.float32
    assert half.native_scales.nbytes * 2 == full.native_scales.nbytes
    assert torch.equal(half.dequantize(0, n, torch.float32), full.dequantize(0, n, torch.float32))
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert fused.int4_gemm_active(x)
    assert torch.equal(half.matmul(x), full.matmul(x))
    assert torch.equal(half.torch_layout()[1], full.torch_layout()[1])
    inexact = Int4Packed.from_affine(q, scale + 1e-5, low, 32, torch.bfloat16)
    assert inexact.native_scales.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 130])
@pytest.mark.parametrize("exact_in_half", [True, False])
def test_int4_kernel_with_float32_activations(native_kernels, rows, exact_in_half):
    """The float32 form of octavo's int4 kernel (CPUs without AVX-512-BF16 run models in
    float32) against the dequantized weight, both scale layouts, rows in chunks of 4 and a
    tail; N = 100 pads to 112."""
    from octavo.kernels import fused

    if not fused.int4_gemm_ready(torch.float32):
        pytest.skip("the float32 int4 kernel needs AVX2 and FMA")
    n, k = 100, 320
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    if not exact_in_half:
        scale = scale + 1e-5
    packed = Int4Packed.from_affine(q, scale, low, 32, torch.float32)
    assert (packed.native_scales.dtype == torch.float16) == exact_in_half
    x = torch.randn(rows, k, generator=g) * 3
    exact = (q.view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, k)
    ref = x.double() @ exact.double().t()
    out = fused.int4_gemm(x, *packed.native_layout())
    assert out.shape == (rows, 112) and out.dtype == torch.float32
    assert ((out[:, :n].double() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert torch.equal(packed.kernel_matmul(x), out[:, :n])  # the Python layer takes it


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("rows", [6, 23, 40])
def test_int4_float32_panel_across_input_chunks(native_kernels, bits, rows):
    """Past a few rows (6 for 5-bit codes, 8 for 8-bit, 20 for 4-bit) the float32 kernel
    multiplies x with a float32 panel of each row block (csrc/panel_gemm.h), 1,024 inputs
    at a time: K = 1,088 takes a second, partial chunk; rows go five at a time, with a tail."""
    from octavo.kernels import fused

    if not fused.int4_gemm_ready(torch.float32):
        pytest.skip("the float32 int4 kernel needs AVX2 and FMA")
    n, k = 40, 1088
    g = torch.Generator().manual_seed(rows * bits)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    low = (-scale * (1 << (bits - 1)) + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
    packed = Int4Packed.from_affine(q, scale, low, 32, torch.float32, bits)
    x = torch.randn(rows, k, generator=g)
    exact = (q.view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, k)
    ref = x.double() @ exact.double().t()
    out = fused.int4_gemm(x, *packed.native_layout())[:, :n].double()
    assert ((out - ref).abs() <= 2e-6 * ref.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("rows", [1, 4, 67])
@pytest.mark.parametrize("group,asym", [(160, False), (32, True), (64, False)])
def test_int8_grouped_matches_reference(rows, group, asym):
    n, k = 72, 320
    q, scale, zero = _codes(n, k, group, 8)
    if not asym:
        zero = torch.full_like(zero, 128)
    packed = Int8Packed(q, scale, zero, group, torch.float32)
    x = torch.randn(rows, k)
    ref = x @ _reference(q, scale, zero, group).t()
    out = packed.matmul(x)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


@pytest.mark.parametrize("rows", [1, 65])
def test_int8_bf16_native_kernel_per_group(native_kernels, rows):
    q, scale, zero = _codes(64, 256, 128, 8)
    packed = Int8Packed(q, scale, zero, 128, torch.bfloat16)
    x = torch.randn(rows, 256).bfloat16()
    ref = x.float() @ _reference(q, scale, zero, 128).t()
    out = packed.matmul(x).float()
    assert (out - ref).norm() / ref.norm() < 1e-2


def test_on_the_fly_quantizers_stay_close_to_the_weight():
    w = torch.randn(128, 256) * 0.05
    x = torch.randn(2, 256)
    ref = x @ w.t()
    for packed, bound in ((quantize_int8(w, torch.float32), 0.01),
                          (quantize_int4(w, 32, torch.float32), 0.12)):
        assert (packed.matmul(x) - ref).norm() / ref.norm() < bound


def test_unpack_orders():
    words = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_cols(words, 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_rows(words, 4).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    neg = torch.tensor([[-1]], dtype=torch.int32)  # all bits set: the sign must not leak
    assert unpack_cols(neg, 8).tolist() == [[255, 255, 255, 255]]


def test_int8_restored_from_a_misaligned_buffer_runs_torchs_kernel():
    """Prepared weights are mapped from a file at any 8-byte offset; torch's int8 kernel needs
    its codes 64-byte aligned (it crashed on SmolLM2 with --quantization int8 at 64 rows)."""
    w = torch.randn(96, 128)
    packed = quantize_int8(w, torch.bfloat16)
    parts = packed.tensors()
    buf = torch.empty(parts["q"].numel() + 64, dtype=torch.int8)
    start = next(i for i in range(64) if (buf.data_ptr() + i) % 64 == 40)
    view = buf[start:start + parts["q"].numel()].view(parts["q"].shape)
    view.copy_(parts["q"])
    restored = Int8Packed.from_tensors({**parts, "q": view})
    assert restored.q.data_ptr() % 64 == 0
    x = torch.randn(64, 128).bfloat16()
    assert torch.equal(restored.matmul(x), packed.matmul(x))


@pytest.mark.parametrize("half_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int4_dequantize_and_tiles_match_the_reference(native_kernels, half_scales,
                                                              dtype):
    """C++ dequantized tiles (prefill from a GGUF's codes, no dense copy) give the Python
    dequantization's weights, and the tiled GEMM the product with them."""
    from octavo.kernels import fused

    n, k = 1000, 4096  # several tiles of a million weights, and N not a multiple of 16
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    if half_scales:
        packed = Int4Packed.from_affine(q, scale, low, 32, dtype)
    else:
        packed = Int4Packed(q, scale, torch.rand(n, k // 32, generator=g) * 15, 32, dtype)
    assert (packed.native_scales.dtype == torch.float16) == half_scales
    ref = packed.dequantize(0, packed.padded_n, dtype)
    got = fused.int4_dequantize(packed.native_codes, packed.native_scales, None, 0,
                                packed.padded_n // 16, dtype)
    assert torch.allclose(got.float(), ref.float(), atol=1e-6 if dtype == torch.float32 else 0)
    part = fused.int4_dequantize(packed.native_codes, packed.native_scales, None, 3, 5, dtype)
    assert torch.equal(part, got[48:128])
    x = torch.randn(DENSE_ROWS, k, generator=g).to(dtype)
    out = packed.matmul(x)
    expect = torch.nn.functional.linear(x, ref[:n])
    assert out.shape == (DENSE_ROWS, n)
    assert torch.allclose(out.float(), expect.float(), rtol=1e-3, atol=1e-3 if dtype ==
                          torch.float32 else 0.5)


@pytest.mark.parametrize("half_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_grouped_tiles_match_the_reference(native_kernels, half_scales, dtype):
    """Grouped int8 weights (a GGUF's Q8_0 / Q6_K codes) past the GEMV's rows: the C++ tiles
    are the Python dequantization bit for bit, and the tiled GEMM the product with them."""
    from octavo.kernels import fused
    from octavo.model.quant.packed import Int8Grouped

    n, k, group = 1100, 2048, 16
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.01
    packed = Int8Grouped(q, scale.half().float() if half_scales else scale * 1.0001, dtype)
    assert (packed.scale.dtype == torch.float16) == half_scales
    ref = packed.dequantize(0, n, dtype)
    assert torch.equal(fused.int8_dequantize(packed.q, packed.scale, 0, n, dtype), ref)
    assert torch.equal(fused.int8_dequantize(packed.q, packed.scale, 7, 30, dtype), ref[7:37])
    x = torch.randn(100, k, generator=g).to(dtype)
    expect = torch.nn.functional.linear(x, ref)
    # the tiles, and what a batch past 64 rows takes (float32 where bf16 is not native: the
    # GEMV's panel)
    for out in (packed.tiled_matmul(x), packed.matmul(x)):
        assert torch.allclose(out.float(), expect.float(), rtol=1e-3,
                              atol=1e-3 if dtype == torch.float32 else 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["int4_rows", "torch"])
def test_packed_rows_are_the_dequantized_rows(native_kernels, kernels, dtype):
    """An embedding kept packed looks its rows up in the codes (the C++ int4_rows, or torch ops
    without the kernels): the same values as the whole weight dequantized."""
    from octavo.model.quant.packed import quantize_int8_grouped

    w = torch.randn(70, 96)
    ids = torch.tensor([0, 69, 17, 17, 33, 16, 15])
    fused.enable_native(kernels)  # the fixture puts the kernels back
    for packed in (quantize_int4(w, 32, dtype),
                   Int4Packed.from_affine(*[t.half().float() if t.is_floating_point() else t
                                            for t in _affine(w)], 32, dtype),
                   quantize_int8_grouped(w, 32, dtype)):
        full = packed.dequantize(0, 70, dtype)
        assert torch.equal(packed.rows(ids), full[ids]), type(packed).__name__
    if kernels:
        packed = quantize_int4(w, 32, dtype)
        with pytest.raises(RuntimeError, match="row 80 is outside"):
            packed.rows(torch.tensor([3, 80]))


def _affine(w):
    from octavo.model.quant.packed import minmax_int4
    return minmax_int4(w, 32)


@pytest.mark.parametrize("n, k, group", [(40, 1088, 16), (37, 256, 32), (21, 96, 96)])
@pytest.mark.parametrize("rows", [20, 23])
def test_int8_float32_panel(native_kernels, n, k, group, rows):
    """Past 20 rows the int8 GEMV multiplies float32 x with float32 panels of 16 weight rows
    (csrc/panel_gemm.h), 8 inputs of 8 rows transposed at a time: groups of 16 and 32, one
    scale a row (group = K), K in two chunks, a partial last block (N = 37, 21)."""
    from octavo.kernels import fused

    if not fused.int4_gemm_ready(torch.float32):
        pytest.skip("the float32 panel needs AVX2 and FMA")
    g = torch.Generator().manual_seed(rows + n)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    for s in (scale, scale.half()):  # float32 and float16 scales; [N] when one a row
        s = s.view(n) if group == k else s
        exact = (q.double().view(n, -1, group) * s.double().view(n, -1, 1)).view(n, k)
        ref = x.double() @ exact.t()
        out = fused.int8_gemv(x, q, s).double()
        assert ((out - ref).abs() <= 2e-6 * ref.abs().amax(1, keepdim=True)).all()
