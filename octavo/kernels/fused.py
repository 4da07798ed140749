"""Fused ops of the decode hot path: the C++ kernel when it is loaded and the tensors are on the
CPU, otherwise the PyTorch reference next to it (which the tests compare the kernel with)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import native
from octavo.kernels.native import Kernels
from octavo.platform import cpu_platform

_native: Kernels | None = None
_mode = "off"


def enable_native(mode: str | bool = "on") -> bool:
    """Choose the kernels for this process: "on" (build or load now), "background" (build in a
    thread and switch over when done), "off"; returns whether the C++ ones are in use now."""
    global _native, _mode
    _mode = "on" if mode is True else "off" if mode is False else mode
    if _mode == "on":
        _native = native.load()
    elif _mode == "background":
        _native = native.load(block=False, on_ready=_switch_on)
    else:
        _native = None
    return _native is not None


def _switch_on(module: Kernels) -> None:
    global _native
    if _mode == "background":  # unless the kernels were turned off since
        _native = module


def native_ready() -> bool:
    return _native is not None


def native_module() -> Kernels:
    """The loaded C++ module (for callers that keep its objects, such as the decode stack)."""
    if _native is None:
        raise RuntimeError("octavo's C++ kernels are not loaded")
    return _native


def native_active(x: torch.Tensor) -> bool:
    return _native is not None and x.device.type == "cpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if native_active(x) and x.is_contiguous() and weight.dtype == x.dtype:
        return _native.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def one_plus_rms_norm(x: torch.Tensor, plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) times `plus_one` (1 + w, float32) in float32, rounded once
    to x's dtype."""
    if native_active(x) and x.dtype in (torch.bfloat16, torch.float32):
        return _native.one_plus_rms_norm(x.contiguous(), plus_one, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * plus_one).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, step_angles: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, KVH, D]. cos/sin: [max_positions, D / 2] fp32
    tables; step_angles: their rows at `positions`, as [T, 1, D / 2], for the reference. The
    kernel rotates in place (q and k may be views of the fused qkv output)."""
    if native_active(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        _native.rotary_inplace(q, positions, cos, sin)
        _native.rotary_inplace(k, positions, cos, sin)
        return q, k
    c, s = step_angles
    return rotate_reference(q, c, s), rotate_reference(k, c, s)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a packed [T, 2 * W] projection."""
    if native_active(x) and x.dim() == 2 and x.is_contiguous():
        return _native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def delta_rule_step(state: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gated delta rule's step of one token per request, on the float32 states [N, H, d_k,
    d_v] at `rows` [R] (distinct), in place: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T;
    returns o = S^T q [R, H, d_v]. q, k [R, H, d_k], v [R, H, d_v], beta, g [R, H], float32."""
    if native_active(state):
        return _native.delta_rule_step(state, rows, q.contiguous(), k.contiguous(),
                                       v.contiguous(), beta.contiguous(), g.contiguous())
    return delta_rule_step_reference(state, rows, q, k, v, beta, g)


def delta_rule_step_reference(state: torch.Tensor, rows: torch.Tensor, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                              g: torch.Tensor) -> torch.Tensor:
    s = state[rows] * g.exp()[..., None, None]  # [R, H, dk, dv]
    delta = (v - torch.einsum("rhkv,rhk->rhv", s, k)) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state[rows] = s
    return torch.einsum("rhkv,rhk->rhv", s, q)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up of a packed [T, 2 * W] projection (GeGLU)."""
    if native_active(x) and x.dim() == 2 and x.is_contiguous():
        return _native.gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


FP8_MAX = 448.0  # largest float8_e4m3fn


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's keys and values ([T, num_kv_heads, head_dim]) in their slots. An fp8
    cache stores k / k_scale and v / v_scale, saturated at the e4m3 range (in torch: a few
    hundred values per token)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        _, _, _, kvh, d = kv_cache.shape
        for cache, x, s in ((kv_cache[0], k, k_scale), (kv_cache[1], v, v_scale)):
            x8 = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            cache.view(-1, kvh, d).view(torch.uint8).index_copy_(0, slot_mapping,
                                                                  x8.view(torch.uint8))
        return
    if native_active(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
        _native.write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)
        return
    _, _, _, kvh, d = kv_cache.shape
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def decode_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                     token_index: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, softcap: float | None,
                     window: int | None, lse: torch.Tensor | None = None) -> None:
    """Single-query attention read in place from the paged cache: out[token_index[r]] for each
    request r with context seq_lens[r] (C++ only; the reference is paged_attention's padded
    group path). lse: a float32 [tokens, heads] that receives each query's log-sum-exp."""
    _native.decode_attention(out, q, kv_cache[0], kv_cache[1], token_index, block_table,
                             seq_lens, scale, softcap or 0.0, window or 0, lse)


def prompt_runs_ready(kv_cache: torch.Tensor) -> bool:
    """Whether decode_attention computes prompts 16 query tokens at a time over this cache
    (bf16, head size 64, 128 or 256, AVX-512-BF16): then it beats SDPA at every length."""
    return (_native is not None and _native.has_prompt_runs and kv_cache.device.type == "cpu"
            and kv_cache.dtype == torch.bfloat16 and kv_cache.shape[-1] in (64, 128, 256))


def int4_gemm_ready(dtype: torch.dtype) -> bool:
    """Whether octavo's int4 kernel can run with activations of `dtype`: C++ loaded, on a CPU
    with AVX-512-BF16 for bf16, with AVX2 and FMA for float32."""
    if _native is None:
        return False
    if dtype == torch.bfloat16:
        return _native.has_int4_gemm
    return dtype == torch.float32 and _native.has_int4_gemm_f32


def int4_gemm_active(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and int4_gemm_ready(x.dtype)


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              high_bits: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 or float32 times int4 weights in octavo's layout
    (Int4Packed.native_layout; with `high_bits`, 5- or 8-bit codes and bf16 x) -> [M, N padded to
    16] in x's dtype (C++ only; Int4Packed.dequantize is the reference)."""
    return _native.int4_gemm(x.contiguous(), codes, scales, high_bits)


def int4_int8_gemm_ready(dtype: torch.dtype) -> bool:
    """Whether packed weights' large batches of `dtype` activations take them quantized to
    int8 (int4_int8_gemm): bf16 ones on a CPU with AVX-512 VNNI and no AMX (whose bf16 tile
    units run the dense GEMM on dequantized tiles faster); float32 ones where bf16 is not native
    (so that float32 is `--dtype auto`'s plan: AVX2), there 2x the float32 GEMM's speed; on a
    CPU with native bf16, float32 is asked for and stays exact. A packed weight takes it only
    in `--dtype auto`'s plan (PackedWeight.quantized_activations)."""
    if _native is None:
        return False
    if dtype == torch.bfloat16:
        return _native.has_int4_int8_gemm and not cpu_platform().amx
    return (dtype == torch.float32 and _native.has_int4_int8_gemm_f32
            and not cpu_platform().native_bf16)


def panel_ready(dtype: torch.dtype) -> bool:
    """Whether octavo's int4 kernel and int8 GEMV outrun the tiles at every batch of `dtype`
    activations, where past a few rows they multiply them with a float32 panel of each block of
    16 weight rows (csrc/panel_gemm.h): float32 ones, measured on AVX2 (Zen 2) and AVX-512 (Zen
    4) CPUs. Not on AMX CPUs, unmeasured there: their float32 GEMM has two full 512-bit FMA units
    against the panel's 256-bit FMAs."""
    return int4_gemm_ready(dtype) and dtype == torch.float32 and not cpu_platform().amx


def int4_int16_gemm_ready(dtype: torch.dtype) -> bool:
    """Whether batches of `dtype` activations may take them quantized to int16
    (int4_int16_gemm): float32 ones where bf16 is not native, C++ built with AVX2."""
    return (dtype == torch.float32 and _native is not None and _native.has_int4_int16_gemm
            and not cpu_platform().native_bf16)


def int4_int16_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    high_bits: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32, quantized to int16 per row and 32 inputs, times codes in octavo's int4
    layout -> [M, N padded to 16] float32 (C++ only; csrc/int4_int16_avx2.h states the
    arithmetic)."""
    return _native.int4_int16_gemm(x.contiguous(), codes, scales, high_bits)


def int4_int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   high_bits: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 or float32, quantized to int8 per row and 32 inputs, times codes in octavo's
    int4 layout (Int4Packed.native_layout) -> [M, N padded to 16] in x's dtype (C++ only;
    csrc/int4_int8_gemm.h states the arithmetic)."""
    return _native.int4_int8_gemm(x.contiguous(), codes, scales, high_bits)


def int4_dequantize_ready() -> bool:
    return _native is not None and hasattr(_native, "int4_dequantize")


def int4_dequantize(codes: torch.Tensor, scales: torch.Tensor, high_bits: torch.Tensor | None,
                    first_block: int, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Row blocks [first_block, first_block + blocks) of int4 weights in octavo's layout, dense
    [16 * blocks, K] in dtype (bf16 or float32; C++ only: Int4Packed.dequantize is the
    reference)."""
    return _native.int4_dequantize(codes, scales, high_bits, first_block, blocks,
                                   dtype == torch.bfloat16)


def int4_tiled_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      high_bits: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times int4 weights in octavo's layout -> [M, N padded to 16], the weight
    dequantized tile by tile into the dense GEMM (large batches; C++ only)."""
    return _native.int4_tiled_linear(x.contiguous(), codes, scales, high_bits)


def int4_rows(codes: torch.Tensor, scales: torch.Tensor, high_bits: torch.Tensor | None,
              ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [T] of int4 weights in octavo's layout (an embedding's lookups), [T, K] in
    dtype (bf16 or float32), valued as int4_dequantize values them (C++ only: Int4Packed.rows
    holds the reference)."""
    return _native.int4_rows(codes, scales, high_bits, ids, dtype == torch.bfloat16)


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, first: int, count: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows [first, first + count) of grouped int8 weights (q [N, K], scale [N, G]), dense
    [count, K] in dtype (bf16 or float32; C++ only: Int8Grouped.dequantize is the reference)."""
    return _native.int8_dequantize(q, scale, first, count, dtype == torch.bfloat16)


def int8_tiled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times grouped int8 weights -> [M, N], dequantized tile by tile into the dense
    GEMM (large batches; C++ only)."""
    return _native.int8_tiled_linear(x.contiguous(), q, scale)


def microscaled_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     code_lut: torch.Tensor, scale_lut: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] times a microscaled weight (csrc/microscaled.h), each block of codes decoded
    once for every row of x (C++ only)."""
    return _native.microscaled_gemv(x.contiguous(), codes, scales, code_lut, scale_lut, block)


def microscaled_tiled_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                             code_lut: torch.Tensor, scale_lut: torch.Tensor,
                             block: int) -> torch.Tensor:
    """x [M, K] bf16 or float32 times a microscaled weight -> [M, N] in x's dtype, a tile of
    rows at a time dequantized into the dense GEMM (large batches; C++ only)."""
    return _native.microscaled_tiled_linear(x.contiguous(), codes, scales, code_lut, scale_lut,
                                            block)


def microscaled_dequantize(codes: torch.Tensor, scales: torch.Tensor, code_lut: torch.Tensor,
                           scale_lut: torch.Tensor, block: int, first: int,
                           count: int) -> torch.Tensor:
    """Rows [first, first + count) of a microscaled weight as float32 (C++ only)."""
    return _native.microscaled_dequantize(codes, scales, code_lut, scale_lut, block, first,
                                          count)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int8 weights q [N, K] with float32 scales: one per row [N], or one per
    group of inputs [N, G] (C++ only; the weights are read once for up to 8 rows of x at a
    time, from cache for the next 8)."""
    return _native.int8_gemv(x.contiguous(), q, scale)
