"""Weight-only quantized matrices as the kernels read them: int4 per group, int8 per group or
channel, each with scales and zero points; built from integer codes by every format's loader.

A weight is w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]) with g = k // group, after an optional
permutation of the inputs (GPTQ's act-order: x[:, perm] meets the columns sorted by group).
Batches of up to `dense_rows` rows (decode, also batch 32) run torch's packed int4 kernel or an
int8 kernel (octavo's AVX-512 GEMV in bf16 for <= 8 rows, else torch's) straight on the packed
bytes: their time grows with the rows (one pass over the weights per row or few), so larger
batches (prefill chunks; large_batch_matmul) dequantize one tile of output rows at a time into
the activation dtype and use the dense GEMM, the whole matrix never dequantized at once, or, for
int4-layout codes in `--dtype auto`'s plan (PackedWeight.quantized_activations) with bf16
activations on a CPU with AVX-512 VNNI and no AMX or float32 ones on a CPU without native bf16,
quantize the activations to int8 and take vpdpbusd / vpmaddubsw products with the codes
(csrc/int4_int8_gemm.h); there float32 batches up to `dense_rows` take int16 activations
(csrc/int4_int16_avx2.h).

Measured (bf16, 2 threads, SmolLM2's gate/up 3072 x 576; microseconds; dense bf16 in brackets):
rows      1          4          16         32          128           512
int4   55 [136]   91 [172]   339 [294]  668 [433]   2702 [1232]  10760 (tile: 8261)
int8   56         104        399        785 (tile 848) 3121 (tile 1994)
so the int4 kernel is used up to 256 rows and the int8 one up to 64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import fused
from octavo.platform import cpu_platform

_TILE_ELEMS = 1 << 20  # weights dequantized per tile (2 MiB of bf16: stays in L2)

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
# With float32 activations (CPUs without AVX-512-BF16; csrc/int4_gemm.h, int4_block_f32) the kernel
# stays ahead of the float32 GEMM far longer: on an AMD EPYC with AVX2 only (2 threads), the
# same layers took 3.1 ms at 1 row against 31.2, 46.5 vs 78.5 at 32, 93.5 vs 120.1 at 64, 187.1
# vs 206.1 at 128 and 393.3 vs 373.4 at 256. The int8 LM head there: 1.8 vs 9.4 ms at 1 row,
# 22.8 vs 37.7 at 32, 45.1 vs 43.2 at 64.
INT4_ROWS_F32 = 128
# Past 6-20 rows (by code width) the float32 kernel dequantizes each row block once into a
# float32 panel and multiplies every row with it (csrc/panel_gemm.h). On an AMD EPYC with
# AVX2 only (Zen 2, 2 threads, cache-hot) it beats the tiles at every batch: Qwen2.5's gate/up
# (9,728 x 896) at 512 rows 46.9 ms against the tiles' 72.0 (torch's float32 GEMM on the dense
# weight, 512 x 896 x 4,864: 42.3 ms for half of it); Gemma 3's LM head (262,144 x 640,
# 8-bit codes) at 64 rows 139 against 385. A packed weight alone takes it for every batch there.
# On an AMD EPYC with AVX-512 (Zen 4), where float32 is asked for, it beats the tiles too: the
# same gate/up at 16 / 128 / 512 rows 2.17 / 15.5 / 57.7 ms against 4.36 / 16.7 / 61.0.
PANEL_ROWS = 1 << 40
INT8_ROWS_F32 = 32
# 8-bit codes in the int4 layout (two planes of nibbles, 4 rows of x a pass) cost the kernel
# about twice the 4-bit work per row, and the tiles win sooner. AMD EPYC AVX-512 (bf16, 2
# threads, cache-hot), kernel against tiles in ms: a quarter of Gemma 3's LM head (65,536 x
# 640) 7.04 vs 10.70 at 16 rows, 10.83 vs 12.12 at 24, 14.29 vs 13.68 at 32, 27.92 vs 19.53 at
# 64; Qwen2.5's gate/up (9,728 x 896) 2.33 vs 2.52 at 24, 2.88 vs 2.82 at 32. 5-bit codes stay
# ahead at 64 rows (the LM head quarter 15.97 vs 19.03, gate/up 3.19 vs 4.22): the 4-bit limit.
INT8_CODES_ROWS = 24


def int4_rows(dtype: torch.dtype, bits: int = 4) -> int:
    """The most rows octavo's int4 kernel takes, with activations of `dtype` and `bits`-bit
    codes, before the dense GEMM (on a dense weight, or on tiles dequantized from the codes)
    wins on this CPU."""
    if dtype == torch.float32:
        return INT4_ROWS_F32
    rows = INT4_ROWS_AMX if cpu_platform().amx else INT4_ROWS
    return min(rows, INT8_CODES_ROWS) if bits == 8 else rows


class PackedWeight:
    """Common part: input permutation, the choice between packed kernel and dense tiles.
    `tensors()` / `from_tensors()` save and restore one (prepared weights, prepared_cache.py)."""

    out_features: int
    in_features: int
    perm: torch.Tensor | None
    dense_rows = 64  # above this many rows: large_batch_matmul
    # Whether products may take their activations quantized where a kernel computes them:
    # large batches to int8 (fused.int4_int8_gemm_ready), the others to int16
    # (fused.int4_int16_gemm_ready). `--dtype auto`'s plan, set at load (quant/weights.py,
    # allow_quantized_activations); an explicit dtype computes exactly in it.
    quantized_activations = False

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if x.shape[0] <= self.dense_rows:
            return self.kernel_matmul(x)
        return self.large_batch_matmul(x)

    def large_batch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (permuted already) times the weight, for batches past the kernel's rows."""
        return self.tiled_matmul(x)

    def tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (permuted already) times the weight, dequantized one tile of rows at a time."""
        rows = max(64, _TILE_ELEMS // self.in_features // 64 * 64)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        for start in range(0, self.out_features, rows):
            end = min(start + rows, self.out_features)
            out[:, start:end] = F.linear(x, self.dequantize(start, end, x.dtype))
        return out

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start:end of the weight, [end - start, K] (in permuted input order)."""
        raise NotImplementedError

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight dequantized, [T, K] in the activation dtype (an
        embedding kept packed looks its tokens up so)."""
        raise NotImplementedError(f"{type(self).__name__} weights cannot serve an embedding")


class Int4Packed(PackedWeight):
    """4-bit codes with a float32 scale and zero per 32 inputs, w = (q - 8) * scale + zero
    (torch's form), held in the layout of octavo's int4 kernel (csrc/int4_gemm.h, int4_block):
    codes [N / 16, K / 4, 32] bytes, byte 2r + j of (row block b, quad c) holding row 16b + r's
    inputs 4c + j (low nibble) and 4c + 2 + j (high nibble); scale and zero
    [N / 16, K / 32, 2, 16]. N is padded to a multiple of 16 with zero rows, sliced off after.
    The scales stay as exact as the checkpoint gave them: rounded to bf16 they would shift every
    weight of a group alike. Affine ones that float16 holds exactly (a GGUF's Q4_0/Q4_1 scales
    and minimums are float16) are kept as float16 scale and low, and the kernel makes the zero
    from them with the same float32 operations: the same products from 5/6 of the bytes, and a
    decode step reads the weights at memory speed. Others keep float32 scale and zero. torch's
    int4 layout (its kernel serves CPUs without AVX-512-BF16 and runs with the C++ kernels off;
    bf16 scales there) is built from this on first use.
    5- and 8-bit codes (a GGUF's Q5_0, w = d * q - 16 d, and Q8_0, w = d * q - 128 d with q
    unsigned; `from_affine(..., bits=5 or 8)`) keep their low 4 bits so and the rest in
    `native_high`: 5 bits, [N / 16, K / 4, 2] int32, bit 2r + j of word h of (row block b,
    quad c) the fifth bit of the code in nibble h of byte 2r + j; 8 bits, [N / 16, K / 4, 32]
    uint8, the high nibbles laid out as the low ones (see csrc/int4_gemm.h). octavo's kernel
    runs them with bf16 (AVX-512-BF16) and float32 (AVX2) activations (kernel_ready)."""

    @property
    def dense_rows(self) -> int:
        """With octavo's kernel, its crossover with the dense GEMM on this CPU (int4_rows);
        torch's int4 kernel (bf16, 2 threads, the table above) stays ahead up to 256 rows.
        In float32 (but on AMX CPUs), the float32 kernel's panel beats the tiles at every batch
        (panel_ready)."""
        if not fused.int4_gemm_ready(self.dtype):
            return 256
        rows = PANEL_ROWS if fused.panel_ready(self.dtype) else int4_rows(self.dtype, self.bits)
        # Packed alone, the int8 product takes over where it does in bf16 (its accuracy was
        # measured there: docs/performance.md), before the float32 kernel's crossover.
        return min(rows, INT4_ROWS) if self.int8_product_ready(self.dtype) else rows

    def int8_product_ready(self, dtype: torch.dtype) -> bool:
        """Whether large batches of `dtype` activations take the int8 product; 8-bit codes
        with float32 activations do not: the exact panel computes them faster."""
        return (self.quantized_activations and fused.int4_int8_gemm_ready(dtype)
                and not (dtype == torch.float32 and self.bits == 8))

    def int16_product_ready(self, dtype: torch.dtype) -> bool:
        """Whether batches of `dtype` activations up to `dense_rows` take the int16 product
        (csrc/int4_int16_avx2.h): float32 activations where bf16 is not native, every code
        width. AMD EPYC Zen 3 with AVX2, 2 threads, against the exact float32 kernel and its
        panel: 1.1-1.4x for 4-bit codes, 1.3-1.9x for 5-bit and 8-bit, from 1 row to 512."""
        return self.quantized_activations and fused.int4_int16_gemm_ready(dtype)

    @staticmethod
    def kernel_ready(dtype: torch.dtype, bits: int) -> bool:
        """Whether octavo's kernel computes `bits`-bit codes (4, 5 or 8) with activations of
        `dtype`."""
        return fused.int4_gemm_ready(dtype) and bits in (4, 5, 8)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 dtype: torch.dtype, perm: torch.Tensor | None = None) -> None:
        """q: [N, K] codes 0..15; scale, zero: [N, K // group] float (w = scale * (q - zero))."""
        scale = scale.float()
        self._pack(q, scale, (8 - zero.float()) * scale, group, dtype, perm, 4)

    @classmethod
    def from_affine(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int,
                    dtype: torch.dtype, bits: int = 4) -> Int4Packed:
        """w = scale * q + low per group (GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 form, and min/max
        quantizing), q unsigned of `bits` (4, 5 or 8) bits: torch's zero is 8 * scale + low,
        with no division, so a zero scale is fine."""
        self = cls.__new__(cls)
        scale, low = scale.float(), low.float()
        if torch.equal(scale.half().float(), scale) and torch.equal(low.half().float(), low):
            self._pack(q, scale.half(), low.half(), group, dtype, None, bits)
        else:
            self._pack(q, scale, 8 * scale + low, group, dtype, None, bits)
        return self

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, zero_or_low: torch.Tensor, group: int,
              dtype: torch.dtype, perm: torch.Tensor | None, bits: int = 4) -> None:
        """float32 scale and zero, or float16 scale and low (see the class)."""
        n, k = q.shape
        if group % 32 or k % 32:  # the kernels' scales are per 32 inputs
            raise ValueError(f"group_size must be a multiple of 32 that divides in_features={k} "
                             f"for the int4 kernel, got {group}")
        if bits not in (4, 5, 8):
            raise ValueError(f"octavo's int4 layout holds 4-, 5- or 8-bit codes, not {bits}")
        self.out_features, self.in_features, self.perm, self.dtype = n, k, perm, dtype
        pad = -n % 16
        self.padded_n = n + pad
        q = F.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(-1, 16, k // 4, 2, 2)  # [b, r, c, h, j]
        self.native_high = None
        if bits == 5:  # bit 2r + j of word h of (b, c): the fifth bit of q[b, r, c, h, j]
            fifth = (q >> 4).to(torch.int64).permute(0, 2, 3, 1, 4).reshape(-1, k // 4, 2, 32)
            words = (fifth << torch.arange(32)).sum(-1)
            self.native_high = (words - (words >> 31 << 32)).to(torch.int32).contiguous()
        if bits == 8:  # the high nibbles, laid out as the low ones
            self.native_high = _nibble_bytes(q >> 4, k)
        self.native_codes = _nibble_bytes(q & 15, k)
        sz = torch.stack([scale, zero_or_low]).repeat_interleave(group // 32, 2)  # [2, N, K/32]
        sz = F.pad(sz, (0, 0, 0, pad)).view(2, -1, 16, k // 32)
        self.native_scales = sz.permute(1, 3, 0, 2).contiguous()
        self._torch_layout: tuple[torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        shape = torch.tensor([self.out_features, self.in_features, self.padded_n])
        out = {"native_codes": self.native_codes, "native_scales": self.native_scales,
               "shape": shape, "dtype": torch.empty(0, dtype=self.dtype)}
        if self.native_high is not None:
            out["native_high"] = self.native_high
        return out if self.perm is None else {**out, "perm": self.perm}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Int4Packed:
        self = cls.__new__(cls)
        self.out_features, self.in_features, self.padded_n = t["shape"].tolist()
        self.native_codes, self.native_scales = t["native_codes"], t["native_scales"]
        self.native_high = t.get("native_high")
        self.dtype, self.perm, self._torch_layout = t["dtype"].dtype, t.get("perm"), None
        return self

    @property
    def bits(self) -> int:
        if self.native_high is None:
            return 4
        return 8 if self.native_high.dtype == torch.uint8 else 5

    def native_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scales, the high plane or None) as octavo's kernel takes them."""
        return self.native_codes, self.native_scales, self.native_high

    def torch_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes, scales and zeros [K / 32, N, 2] in the activation dtype) as torch's
        int4 kernel takes them with groups of 32 inputs; built on first use (4-bit codes)."""
        if self.native_high is not None:
            raise NotImplementedError(f"torch's int4 kernel takes 4-bit codes, not {self.bits}")
        if self._torch_layout is None:
            packed = torch._convert_weight_to_int4pack_for_cpu(
                self.codes(0, self.padded_n).to(torch.int32), 1)
            sz = self._scale_zero().permute(1, 0, 3, 2).reshape(self.in_features // 32, -1, 2)
            self._torch_layout = packed, sz.to(self.dtype).contiguous()
        return self._torch_layout

    def _scale_zero(self) -> torch.Tensor:
        """float32 scale and zero [N / 16, K / 32, 2, 16], made as the kernel makes them."""
        if self.native_scales.dtype == torch.float32:
            return self.native_scales
        scale, low = self.native_scales.float().unbind(2)
        return torch.stack([scale, 8 * scale + low], 2)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if x.device.type == "cpu" and self.int16_product_ready(x.dtype):
            y = fused.int4_int16_gemm(x, *self.native_layout())
        elif x.device.type == "cpu" and self.kernel_ready(x.dtype, self.bits):
            y = fused.int4_gemm(x, *self.native_layout())
        elif self.native_high is not None:  # 5- or 8-bit codes without their kernel
            return super().tiled_matmul(x)
        else:
            packed, scales_zeros = self.torch_layout()
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, 32, scales_zeros)
        return self._unpadded(y)

    def large_batch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """With int8 activations allowed, bf16 x on a CPU with AVX-512 VNNI and no AMX, or
        float32 x where bf16 is not native: x quantized to int8 per row and 32 inputs times the
        codes (int4_int8_gemm: 1.5-2.5x the tiles' speed in bf16, 2x the float32 GEMM's on
        AVX2); else the tiles."""
        x = x.to(self.dtype)
        if x.device.type != "cpu" or not self.int8_product_ready(x.dtype):
            return self.tiled_matmul(x)
        y = fused.int4_int8_gemm(x, *self.native_layout())
        return self._unpadded(y)

    def tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if x.device.type != "cpu" or not fused.int4_dequantize_ready():
            return super().tiled_matmul(x)
        y = fused.int4_tiled_linear(x, *self.native_layout())
        return self._unpadded(y)

    def _unpadded(self, y: torch.Tensor) -> torch.Tensor:
        """The kernels' output [M, N padded to 16] without the padding rows' columns."""
        return y[:, :self.out_features] if self.padded_n != self.out_features else y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if fused.native_active(ids) and self.dtype in (torch.bfloat16, torch.float32):
            return fused.int4_rows(*self.native_layout(), ids.long(), self.dtype)
        return self.rows_reference(ids)

    def rows_reference(self, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape[0], self.in_features
        block, r = ids // 16, ids % 16
        b = self.native_codes[block].view(t, k // 4, 16, 2)[torch.arange(t), :, r]  # [T, c, j]
        q = torch.stack([b & 15, b >> 4], 2)  # [T, c, h, j]: input 4c + 2h + j
        if self.bits == 8:
            b = self.native_high[block].view(t, k // 4, 16, 2)[torch.arange(t), :, r]
            q = q | torch.stack([b & 15, b >> 4], 2) << 4
        elif self.bits == 5:
            lanes = (2 * r)[:, None, None, None] + torch.arange(2)  # [T, 1, 1, j]: bit 2r + j
            q = q | ((self.native_high[block][:, :, :, None] >> lanes) & 1).to(torch.uint8) << 4
        q = q.reshape(t, -1, 32).float() - 8
        sz = self.native_scales[block, :, :, r].float()  # [T, K / 32, 2]
        scale, zero = sz[..., 0:1], sz[..., 1:2]
        if self.native_scales.dtype != torch.float32:  # float16 scale and low (see the class)
            zero = 8 * scale + zero
        return (q * scale + zero).reshape(t, k).to(self.dtype)

    def codes(self, start: int, end: int) -> torch.Tensor:
        """Rows start:end of the 4-bit codes, [end - start, K] uint8."""
        k, first, last = self.in_features, start // 16, (end + 15) // 16
        b = self.native_codes[first:last].view(-1, k // 4, 16, 2)  # [b, c, r, j]
        q = torch.stack([b & 15, b >> 4], 3)  # [b, c, r, h, j]
        if self.bits == 8:
            h = self.native_high[first:last].view(-1, k // 4, 16, 2)
            q = q | torch.stack([h & 15, h >> 4], 3) << 4
        elif self.bits == 5:  # bit 2r + j of word h
            lanes = (2 * torch.arange(16)[:, None, None] + torch.arange(2))  # [r, 1, j]
            words = self.native_high[first:last][:, :, None, :, None]  # [b, c, 1, h, 1]
            q = q | ((words >> lanes) & 1).to(torch.uint8) << 4
        q = q.permute(0, 2, 1, 3, 4).reshape(-1, k)
        return q[start - 16 * first:end - 16 * first]

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.codes(start, end).float().view(end - start, -1, 32) - 8
        sz = self._scale_zero().permute(0, 3, 1, 2).reshape(self.padded_n, -1, 2)[start:end]
        return (q * sz[..., :1] + sz[..., 1:]).reshape(end - start, self.in_features).to(dtype)


def _nibble_bytes(q: torch.Tensor, k: int) -> torch.Tensor:
    """4-bit values q [b, r, c, h, j] (row block, row, quad, nibble, j) -> [N / 16, K / 4, 32]
    bytes, byte 2r + j of (b, c) holding nibble 0 low and nibble 1 high (Int4Packed's layout)."""
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(1, 2)
    return codes.reshape(-1, k // 4, 32).contiguous()


class Int8Packed(PackedWeight):
    """q' = q - 128 as int8, one kernel call per group of inputs (one call when per channel);
    w = scale * (q' - zero'), the zero term added as (sum of x over the group) * scale * zero'."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group: int, dtype: torch.dtype, perm: torch.Tensor | None = None,
                 signed: bool = False) -> None:
        """q: [N, K] codes (0..255, or -128..127 if signed); scale, zero: [N, K // group]."""
        n, k = q.shape
        if k % group:
            raise ValueError(f"group_size {group} must divide in_features={k}")
        self.out_features, self.in_features, self.perm, self.group = n, k, perm, group
        q = q.to(torch.int16) if signed else q.to(torch.int16) - 128
        self.q = q.to(torch.int8).reshape(n, k // group, group).transpose(0, 1).contiguous()
        self.scale = scale.float().t().contiguous()  # [G, N] float32 (octavo's kernel)
        self.scale_dtype = self.scale.to(dtype)  # torch's kernel wants the activation dtype
        self.zero_term = None  # [G, N]: scale * zero' (None when symmetric)
        if zero is not None:
            z = zero.float() - (0 if signed else 128)
            if z.abs().max() > 0:
                self.zero_term = (scale.float() * z).t().contiguous().to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"q": self.q, "scale": self.scale,
               "shape": torch.tensor([self.out_features, self.in_features, self.group])}
        if self.scale_dtype.dtype != self.scale.dtype:  # float32 runs: the same tensor
            out["scale_dtype"] = self.scale_dtype
        if self.zero_term is not None:
            out["zero_term"] = self.zero_term
        return out if self.perm is None else {**out, "perm": self.perm}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Int8Packed:
        self = cls.__new__(cls)
        self.out_features, self.in_features, self.group = t["shape"].tolist()
        # Prepared weights come mapped from a file at any 8-byte offset; torch's int8 kernel
        # reads its codes with aligned vector loads and crashes on them (SmolLM2 int8, 64 rows).
        self.q, self.scale = _aligned(t["q"]), t["scale"]
        self.scale_dtype = t.get("scale_dtype", self.scale)
        self.zero_term, self.perm = t.get("zero_term"), t.get("perm")
        return self

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.scale_dtype.dtype)
        native = fused.native_active(x) and x.dtype == torch.bfloat16 and x.shape[0] <= 8
        y = None
        for g in range(self.q.shape[0]):
            xg = x[:, g * self.group:(g + 1) * self.group].contiguous()
            yg = (fused.int8_gemv(xg, self.q[g], self.scale[g]) if native
                  else torch._weight_int8pack_mm(xg, self.q[g], self.scale_dtype[g]))
            y = yg if y is None else y + yg
        if self.zero_term is not None:
            sums = x.reshape(x.shape[0], -1, self.group).sum(-1)  # [M, G]
            y = y - sums @ self.zero_term
        return y

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.q[:, start:end].to(dtype)  # [G, rows, group]
        w = q * self.scale[:, start:end, None].to(dtype)
        if self.zero_term is not None:
            w = w - self.zero_term[:, start:end, None].to(dtype)
        return w.transpose(0, 1).reshape(end - start, self.in_features)


class Int8Grouped(PackedWeight):
    """w = scale * q with a scale per `group` inputs of a row (q in -127..127): GGUF's Q8_0 as
    it is (group 32). Scales are kept in float16 where float16 holds them exactly (Q8_0's are
    float16; re-quantized ones are rounded to it, quantize_int8_grouped), else float32. Codes
    stay row-major [N, K], so octavo's int8 GEMV reads each row
    once and applies the scales group by group, for up to 64 rows in bf16 (8 at a time over
    the same cached block of weights); larger batches (or no C++ kernels) take dequantized
    tiles and the dense GEMM, except float32 ones (dense_rows)."""

    @property
    def dense_rows(self) -> int:
        """64 rows, or every batch where the GEMV's float32 panel outruns the tiles
        (fused.panel_ready: past 20 rows it multiplies panels, csrc/panel_gemm.h)."""
        return PANEL_ROWS if fused.panel_ready(self.dtype) else 64

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """q: [N, K] codes -127..127; scale: [N, K // group]."""
        n, k = q.shape
        if k % scale.shape[1] or (k // scale.shape[1]) % 16:
            raise ValueError(f"int8 groups must be a multiple of 16 inputs dividing "
                             f"in_features={k}, got {scale.shape[1]} groups")
        self.out_features, self.in_features, self.perm = n, k, None
        self.group = k // scale.shape[1]
        self.q = q.to(torch.int8).contiguous()
        exact_half = scale.dtype == torch.float16 or torch.equal(scale.half().float(), scale)
        self.scale = (scale.half() if exact_half else scale.float()).contiguous()
        self.dtype = dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "scale": self.scale,
                "dtype": torch.zeros(1, dtype=self.dtype)}  # the activation dtype, as a tag

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Int8Grouped:
        return cls(t["q"], t["scale"], t["dtype"].dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not (fused.native_active(x) and x.dtype in (torch.bfloat16, torch.float32)):
            return self.tiled_matmul(x)
        return super().matmul(x)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fused.int8_gemv(x, self.q, self.scale)

    def tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if fused.native_active(x) and x.dtype in (torch.bfloat16, torch.float32):
            return fused.int8_tiled_linear(x, self.q, self.scale)
        return super().tiled_matmul(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids].float().view(ids.shape[0], -1, self.group)
        return (q * self.scale[ids, :, None].float()).view(ids.shape[0], -1).to(self.dtype)

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.q[start:end].float().view(end - start, -1, self.group)
        return (q * self.scale[start:end, :, None].float()).view(end - start, -1).to(dtype)


def quantize_int8_grouped(w: torch.Tensor, group: int, dtype: torch.dtype) -> Int8Grouped:
    """Symmetric int8 per `group` inputs (absmax / 127): Q8_0's own rule, so a Q8_0 tensor's
    dequantized weights give back its codes and scales."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = g.abs().amax(-1) / 127
    normal = scale[scale > 0]
    if normal.numel() == 0 or normal.min() >= 2 ** -14:  # float16's normal range: held to
        scale = scale.half().float()  # 11 bits, the codes made with the rounded scale
    q = (g / scale.clamp(min=1e-30)[..., None]).round().clamp(-127, 127).reshape(n, k)
    return Int8Grouped(q, scale, dtype)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when its data starts on a 64-byte boundary, else an aligned copy."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> Int4Packed:
    """Min/max int4 per group of `group` inputs (on-the-fly quantization): w ≈ scale * q + min,
    the minimum kept exact (a fractional zero point) as GGUF's Q4_1 does: rounding the zero to
    an integer raised SmolLM2's perplexity by 28% against 1% here."""
    return Int4Packed.from_affine(*minmax_int4(w, group), group, dtype)


def minmax_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> codes [N, K] (0..15), scale and minimum [N, K // group]: w ≈ scale * q + min."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(n, k)
    return q, scale, lo


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8Packed:
    """Symmetric int8 per output channel (on-the-fly quantization)."""
    w = w.float()
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-10)
    q = (w / scale).round().clamp(-127, 127)
    return Int8Packed(q, scale, None, w.shape[1], dtype, signed=True)
