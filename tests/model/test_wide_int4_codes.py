"""Q5_0 and Q8_0 weights kept as 5- and 8-bit codes in octavo's int4 layout, with a plane of
fifth bits or of high nibbles (octavo/model/quant/packed.py Int4Packed, csrc/int4_gemm.h,
csrc/dequant.h).

1. On random valid Q5_0 and Q8_0 blocks, the codes, scales and offsets
   (ggml_codes.affine_codes) give back gguf's own dequantization bit for bit, through the C++
   tiles, the Python reference and an embedding's row lookup, and survive the prepared-weights
   round trip.
2. The bf16 kernel (1-8 rows at a time, and the tiles past its rows) gives the float64 product
   of the exact weights to bf16 rounding; without the C++ kernels the reference path does.
3. A tiny Llama GGUF of Q5_0 layers (a Q8_0 v, a Q6_K down projection, a Q5_0 embedding) keeps
   them 5- and 8-bit in bf16 (the plan is inspectable), within 1.15x the file; the decode stack
   computes them as the Python layers do, and both agree with the dense weights; in float32,
   where those kernels do not run, they are int8 codes, exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from octavo.kernels import fused
from octavo.model.quant.ggml_codes import affine_codes
from octavo.model.quant.ggml_types import GGMLType
from octavo.model.quant.packed import Int4Packed, Int8Grouped



def _needs_kernel(dtype: torch.dtype = torch.bfloat16) -> None:
    """After the native_kernels fixture: skip where the wide-code kernel of `dtype` cannot run
    (bf16: AVX-512-BF16; float32: AVX2 and FMA)."""
    if not Int4Packed.kernel_ready(dtype, 5):
        pytest.skip(f"octavo's 5-bit codes with {dtype} activations do not run on this CPU")


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                                 ids=["bf16", "float32"])


_BITS = {Q.Q5_0: 5, Q.Q8_0: 8}
WIDE = pytest.mark.parametrize("qtype", list(_BITS), ids=lambda q: q.name)


def _random_rows(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q5_0 / Q8_0 blocks [rows, row bytes] (22 / 34 bytes per 32 weights) with finite
    f16 scales (Q8_0's codes -127..127, as llama.cpp writes them)."""
    size = 22 if qtype == Q.Q5_0 else 34
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // 32, size), dtype=np.uint8)
    raw[..., :2] = rng.uniform(-0.02, 0.02, (rows, k // 32, 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q8_0:
        codes = raw[..., 2:].view(np.int8)
        codes[codes == -128] = -127
    return raw.reshape(rows, -1)


def _packed(qtype: Q, raw: np.ndarray, dtype: torch.dtype) -> tuple[Int4Packed, torch.Tensor]:
    q, scale, low = (torch.from_numpy(np.ascontiguousarray(a))
                     for a in affine_codes(GGMLType(int(qtype)), raw))
    assert int(q.max()) == 2 ** _BITS[qtype] - 1 and int(q.min()) <= 1
    return Int4Packed.from_affine(q, scale, low, 32, dtype, bits=_BITS[qtype]), q


@WIDE
def test_codes_give_back_the_gguf_weights(native_kernels, qtype):
    rows, k = 40, 512  # 40 rows: the tail row block and its padding are used
    raw = _random_rows(qtype, rows, k, 5)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(rows, k))
    assert reference.abs().max() > 0.1  # the random codes and scales were really used
    packed, q = _packed(qtype, raw, torch.bfloat16)
    assert packed.bits == _BITS[qtype]
    assert packed.native_scales.dtype == torch.float16  # d and -16 d (-128 d)
    assert torch.equal(packed.codes(3, 37), q[3:37])
    ids = torch.tensor([39, 0, 17, 17])
    for reference_path in (False, True):
        if reference_path:
            fused._native = None  # the fixture puts the kernels back
        assert torch.equal(packed.dequantize(0, rows, torch.float32), reference)
        assert torch.equal(packed.dequantize(9, 30, torch.bfloat16), reference[9:30].bfloat16())
        assert torch.equal(packed.rows(ids), reference[ids].bfloat16())  # int4_rows, then torch
    again = Int4Packed.from_tensors(packed.tensors())
    assert again.bits == _BITS[qtype] and torch.equal(again.codes(0, rows), q)


@DTYPES
@WIDE
def test_kernel_and_tiles_compute_the_exact_weights(native_kernels, qtype, dtype):
    _needs_kernel(dtype)
    rows, k = 72, 768
    raw = _random_rows(qtype, rows, k, 6)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(rows, k)).double()
    packed, _ = _packed(qtype, raw, dtype)
    bf16 = dtype == torch.bfloat16
    for m in (1, 3, 4, 5, 8, 13, 64, 100, 300):  # the kernel 8 (4) rows a pass, then tiles
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = packed.matmul(x)
        assert got.dtype == dtype and got.shape == (m, rows)
        exact = x.double() @ reference.t()
        error = (got.double() - exact).abs()
        size = x.double().abs() @ reference.abs().t()
        if not bf16:  # exact weights and float32 sums (the kernel's, or the tiles' GEMM)
            assert (error <= size * 2 ** -18 + 1e-5).all(), m
        elif m <= packed.dense_rows:  # exact weights, float32 sums rounded once to bf16
            # (8-bit codes: their sums, 2184 times the scale, cancel a little more than float32
            # holds)
            assert (error <= exact.abs() * 2 ** -8 + 1e-4).all(), m
        else:  # tiles of bf16 weights (each rounded once) into the bf16 GEMM
            assert (error <= exact.abs() * 2 ** -8 + size * 2 ** -8).all(), m


@DTYPES
def test_four_bit_codes_in_the_wide_layouts_match_the_four_bit_kernel(native_kernels, dtype):
    """A layer mixing Q4 and Q5_0 (or Q8_0) slots keeps the Q4 codes with no high bits: the
    same products as the 4-bit layout (to float32 rounding for the 8-bit sums)."""
    _needs_kernel(dtype)
    w = torch.randn(48, 256)
    from octavo.model.quant.packed import minmax_int4

    q, scale, low = minmax_int4(w, 32)
    four = Int4Packed.from_affine(q, scale, low, 32, dtype)
    five = Int4Packed.from_affine(q, scale, low, 32, dtype, bits=5)
    eight = Int4Packed.from_affine(q, scale, low, 32, dtype, bits=8)
    assert five.native_high is not None and int(five.native_high.abs().sum()) == 0
    assert eight.bits == 8 and int(eight.native_high.sum()) == 0
    x = torch.randn(5, 256).to(dtype)
    assert torch.equal(five.matmul(x), four.matmul(x))
    torch.testing.assert_close(eight.matmul(x), four.matmul(x), rtol=2 ** -7, atol=1e-3)


@WIDE
def test_without_the_kernels_the_reference_path_computes(monkeypatch, qtype):
    raw = _random_rows(qtype, 20, 256, 3)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(20, 256))
    monkeypatch.setattr(fused, "_native", None)
    packed, _ = _packed(qtype, raw, torch.float32)
    x = torch.randn(2, 256)
    torch.testing.assert_close(packed.matmul(x), x @ reference.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="4-bit codes, not"):
        packed.torch_layout()


def _qtypes(name: str) -> Q | None:
    """Q5_0 everywhere but v (Q8_0, as llama.cpp's Q4_K_M files have it), the MLP's down
    projection (Q6_K) and the norms."""
    if name == "token_embd.weight":
        return Q.Q5_0
    if not name.startswith("blk.") or "norm" in name:
        return None
    return {".ffn_down.": Q.Q6_K, ".attn_v.": Q.Q8_0}.get(
        next((p for p in (".ffn_down.", ".attn_v.") if p in name), ""), Q.Q5_0)


def _kinds(llm) -> dict[str, str]:
    model = llm.engine.client.core.executor.worker.runner.model
    out = {}
    for name, m in model.named_modules():
        packed = getattr(getattr(m, "weights", None), "packed", None)
        if packed is not None:
            bits = getattr(packed, "bits", None)
            out[name] = type(packed).__name__ + (f"/{bits}" if bits else "")
    return out


def test_tiny_gguf_keeps_q5_0_and_q8_0_as_wide_int4_codes(tmp_path, smollm_oracle_folder,
                                                          monkeypatch, native_kernels):
    from octavo.model.loader.weights_plan import weight_bytes
    from tests.kernels.test_decode_stack import _stack_then_layers
    from tests.model.test_gguf_packed import _generate, _top5_agree, _write_tiny

    _needs_kernel()
    path = tmp_path / "tiny-q5.gguf"
    _write_tiny(path, _qtypes)
    # Without prefix caching, the stack and the layers compute the same chunks: the kernel up
    # to a weight's rows, bf16 tiles above (cached blocks would mix the two).
    fast, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="bfloat16",
                          enable_prefix_caching=False)
    kinds = _kinds(llm)
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "Int4Packed/8"  # Q5_0 and Q8_0
    assert kinds["model.layers.0.self_attn.o_proj"] == "Int4Packed/5"
    assert kinds["model.layers.1.mlp.gate_up_proj"] == "Int4Packed/5"
    assert kinds["model.layers.1.mlp.down_proj"] == Int8Grouped.__name__  # Q6_K
    assert kinds["model.embed_tokens"] == kinds["lm_head"] == "Int4Packed/5"  # tied
    model = llm.engine.client.core.executor.worker.runner.model
    assert sum(weight_bytes(model).values()) <= 1.15 * path.stat().st_size
    _stack_then_layers(llm, bf16=True)  # the decode stack runs the 5-bit codes as the layers do
    del llm
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="bfloat16",
                         decode_weights="none")
    _top5_agree(fast, dense)


def test_tiny_gguf_q5_0_in_float32_is_exact(tmp_path, smollm_oracle_folder, monkeypatch,
                                            native_kernels):
    from tests.model.test_gguf_packed import (
        _generate,
        _same_tokens_and_prompt_logprobs,
        _write_tiny,
    )

    path = tmp_path / "tiny-q5.gguf"
    _write_tiny(path, _qtypes)
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32",
                         decode_weights="none")
    codes, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32")
    # octavo's float32 kernel (AVX2) runs 5-bit codes: Q5_0 stays in the int4 layout
    wide = Int4Packed.kernel_ready(torch.float32, 5)
    assert _kinds(llm)["model.layers.1.mlp.gate_up_proj"] == (
        "Int4Packed/5" if wide else Int8Grouped.__name__)
    _same_tokens_and_prompt_logprobs(codes, dense)


def test_tiny_gguf_in_auto_float32_takes_int16_activations(tmp_path, smollm_oracle_folder,
                                                           monkeypatch, native_kernels):
    """On a CPU without native bf16 (made so here: any CPU with the AVX2 kernels), dtype auto
    runs float32 with the 5- and 8-bit codes' decode batches on int16-quantized activations:
    the stack computes them as the Python layers do, and tokens and prompt logprobs stay those
    of the dense float32 weights (the int16 rounding is 2^-15 of a group's largest input)."""
    from octavo.kernels import fused
    from octavo.model import decode_stack
    from octavo.platform import CpuPlatform, cpu_platform
    from tests.kernels.test_decode_stack import _stack_then_layers
    from tests.model.test_gguf_packed import _generate, _top5_agree, _write_tiny

    if not fused._native.has_int4_int16_gemm:
        pytest.skip("the int16-activation kernel needs AVX2")
    platform = CpuPlatform(frozenset(set(cpu_platform().flags)
                                     - {"avx512_bf16", "amx_bf16", "amx_tile"}))
    monkeypatch.setattr("octavo.kernels.fused.cpu_platform", lambda: platform)
    monkeypatch.setattr("octavo.worker.worker.cpu_platform", lambda: platform)
    path = tmp_path / "tiny-q5.gguf"
    _write_tiny(path, _qtypes)
    calls = []
    real = fused.int4_int16_gemm
    monkeypatch.setattr(fused, "int4_int16_gemm", lambda *a: calls.append(1) or real(*a))
    auto, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="auto",
                          enable_prefix_caching=False)
    model = llm.engine.client.core.executor.worker.runner.model
    assert model.lm_head.weights.packed.dtype == torch.float32
    layer = model.model.layers[1]
    assert decode_stack._kind(layer.mlp.gate_up_proj.weights.packed) == "int4_int16"
    assert calls  # the Python LM head (5-bit, tied) took it
    _stack_then_layers(llm, bf16=False)
    del llm
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32",
                         decode_weights="none")
    # A tiny random model's logits have near ties (one prompt's top two 2e-4 apart): the
    # greedy tokens agree to the top-5 criterion, the prompt logprobs within 1e-3.
    _top5_agree(auto, dense)
    for x, y in zip(auto, dense):
        pairs = [(a[t].logprob, b[t].logprob) for a, b, t in
                 zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], x.prompt_token_ids[1:])]
        assert max(abs(a - b) for a, b in pairs) < 1e-3
