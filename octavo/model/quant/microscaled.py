"""Microscaled weights kept packed: OCP MX (MXFP4: e2m1 codes, MXFP8: e4m3 codes, each block of
32 inputs with an e8m0 scale byte), NVFP4 (e2m1 codes, an e4m3 scale per 16 inputs times a
tensor scale) and FP8 (e4m3 codes with a float32 scale per row or per block: quant/fp8.py).
w[n, k] = scale[n, k / block] * code_lut[code], the scale a byte read through scale_lut or a
float; 4-bit codes pack two a byte, the even input in the low nibble (the OCP and gpt-oss
layout).

A weight keeps its bytes: 4.25 bits a weight for MXFP4 (the codes and one scale byte per 32).
Small batches (decode) run csrc/microscaled.h's GEMV, which decodes each block once for every
row; larger ones dequantize a tile of rows at a time into the activation dtype for the dense GEMM
(microscaled_tiled_linear), the whole matrix never dequantized at once. The decode stack runs the
same two kernels. Without the C++ kernels the same tables decode in torch.

Checkpoints: gpt-oss's MXFP4 experts (`quant_method: mxfp4`: `<proj>_blocks` [.., N, K / 32, 16]
and `<proj>_scales` [.., N, K / 32], split per expert by model/models/gpt_oss.py) load through
`MXSpec`, compressed-tensors' and ModelOpt's NVFP4 through `NVFP4Spec`, ModelOpt's MXFP8
through `MXSpec` too.
"""
from __future__ import annotations

from typing import Any

import torch

from octavo.kernels import fused
from octavo.model.quant.packed import PackedWeight

# e2m1: sign, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_table() -> torch.Tensor:
    """The 256 e8m0 scales, 2^(s - 127) (255, NaN in the OCP spec, reads as 2^128 = inf)."""
    return torch.ldexp(torch.ones(256, dtype=torch.float64),
                       torch.arange(256) - 127).float()


def e4m3_table() -> torch.Tensor:
    """The 256 float8_e4m3fn values, by byte."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


class MicroscaledPacked(PackedWeight):
    """codes [N, K * bits / 8] as uint8 and scales [N, K / block], uint8 read through
    `scale_lut` (256 floats) or float32 (`scale_lut` empty: FP8 checkpoints' scales), with the
    codes' table (16 or 256 floats)."""

    dense_rows = 16  # past this many rows: dequantized tiles into the dense GEMM

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, code_lut: torch.Tensor,
                 scale_lut: torch.Tensor, block: int, dtype: torch.dtype) -> None:
        bits = 4 if code_lut.numel() == 16 else 8
        n, k = codes.shape[0], codes.shape[1] * 8 // bits
        float_scales = scale_lut.numel() == 0
        if code_lut.numel() not in (16, 256) or scale_lut.numel() not in (0, 256):
            raise ValueError("microscaled weights need 16 or 256 code values and 256 scales "
                             "(or float32 scales)")
        if block % 16 or k % block or tuple(scales.shape) != (n, k // block):
            raise ValueError(f"microscaled weight of {n} rows x {k} inputs in blocks of {block} "
                             f"(a multiple of 16): scales must be [{n}, {k // block}], got "
                             f"{tuple(scales.shape)}")
        self.out_features, self.in_features, self.perm = n, k, None
        self.codes = codes.contiguous().view(torch.uint8)
        self.scales = (scales.float() if float_scales else scales.to(torch.uint8)).contiguous()
        self.code_lut = code_lut.float().contiguous()
        self.scale_lut = scale_lut.float().contiguous()
        self.block, self.bits, self.dtype = block, bits, dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "code_lut": self.code_lut,
                "scale_lut": self.scale_lut, "block": torch.tensor(self.block),
                "dtype": torch.zeros(1, dtype=self.dtype)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> MicroscaledPacked:
        return cls(t["codes"], t["scales"], t["code_lut"], t["scale_lut"], int(t["block"]),
                   t["dtype"].dtype)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if fused.native_active(x):
            return fused.microscaled_gemv(x, *self.native_layout())
        return self.tiled_matmul(x)

    def tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if fused.native_active(x) and x.dtype in (torch.bfloat16, torch.float32):
            return fused.microscaled_tiled_linear(x, *self.native_layout())
        return super().tiled_matmul(x)

    def native_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     int]:
        """What the C++ kernels take: codes, scales, the codes' table, the scales' table (empty:
        float32 scales) and the block."""
        return self.codes, self.scales, self.code_lut, self.scale_lut, self.block

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        if fused.native_active(self.codes):
            w = fused.microscaled_dequantize(self.codes, self.scales, self.code_lut,
                                             self.scale_lut, self.block, start, end - start)
            return w.to(dtype)
        return self.reference(start, end).to(dtype)

    def reference(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows start:end as float32, decoded in torch (the kernels' reference)."""
        codes = self.codes[start:end]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
        values = self.code_lut[codes.long()].view(codes.shape[0], -1, self.block)
        scales = self.scales[start:end]
        scales = scales if self.scale_lut.numel() == 0 else self.scale_lut[scales.long()]
        return (values * scales.unsqueeze(-1)).view(codes.shape[0], -1)


def fp8_packed(w8: torch.Tensor, scales: torch.Tensor, block: int,
               dtype: torch.dtype) -> MicroscaledPacked:
    """float8_e4m3fn weights [N, K] with float32 scales [N, K / block] (one block: a scale per
    row), kept as their bytes."""
    return MicroscaledPacked(w8.view(torch.uint8), scales.float(), e4m3_table(),
                             torch.empty(0), block, dtype)


def nvfp4_groups(qc: dict[str, Any]) -> bool:
    """Whether a compressed-tensors quantization_config is NVFP4 (4-bit float weights in groups
    of 16: `nvfp4-pack-quantized`); ValueError where its groups mix it with another scheme."""
    groups = [((g or {}).get("weights") or {}) for g in (qc.get("config_groups") or {}).values()]
    fp4 = [w.get("type") == "float" and w.get("num_bits") == 4 for w in groups]
    if any(fp4) and not all(fp4):
        raise NotImplementedError("quantization_config.config_groups: NVFP4 groups beside "
                                  "others in one checkpoint")
    if any(fp4) and any(w.get("group_size", 16) != 16 for w in groups):
        raise NotImplementedError("quantization_config.config_groups: NVFP4 with a group_size "
                                  "other than 16")
    return bool(groups) and all(fp4)


class NVFP4Spec:
    """NVFP4 checkpoints: each layer's e2m1 codes [N, K / 2], e4m3 scales [N, K / 16] and one
    global float, as compressed-tensors writes them (`nvfp4-pack-quantized`: `weight_packed`,
    `weight_scale`, `weight_global_scale`, which the scales are divided by) or ModelOpt
    (`quant_algo: NVFP4`: `weight`, `weight_scale`, `weight_scale_2`, which they are multiplied
    by). The activations' input scales are not needed (they stay in bf16/float32). Packed
    slots that share one global scale keep their scale bytes; slots with different ones (q, k
    and v quantized apart) get float32 scales."""

    def __init__(self, qc: dict[str, Any], modelopt: bool = False) -> None:
        self.qc = qc
        self.codes, self.global_name = (("weight", "weight_scale_2") if modelopt
                                        else ("weight_packed", "weight_global_scale"))
        self.divides = not modelopt

    def build(self, parts: list[dict[str, torch.Tensor]], widths: list[int], k: int,
              dtype: torch.dtype) -> MicroscaledPacked:
        codes, scales, factors = [], [], []
        for part, width in zip(parts, widths):
            missing = {self.codes, "weight_scale", self.global_name} - set(part)
            if missing:
                raise ValueError(f"nvfp4 checkpoint: a quantized layer lacks {sorted(missing)}")
            c, s = part[self.codes], part["weight_scale"]
            if tuple(c.shape) != (width, k // 2) or tuple(s.shape) != (width, k // 16):
                raise ValueError(f"nvfp4 checkpoint: {self.codes} {tuple(c.shape)} and "
                                 f"weight_scale {tuple(s.shape)} for a slot of {width} rows x "
                                 f"{k} inputs")
            codes.append(c.view(torch.uint8))
            scales.append(s.view(torch.uint8))
            g = float(part[self.global_name].float().reshape(-1)[0])
            factors.append(1.0 / g if self.divides else g)
        table = e4m3_table()
        if len(set(factors)) == 1:
            return MicroscaledPacked(torch.cat(codes), torch.cat(scales),
                                     torch.tensor(FP4_VALUES), table * factors[0], 16, dtype)
        float_scales = torch.cat([table[s.long()] * f for s, f in zip(scales, factors)])
        return MicroscaledPacked(torch.cat(codes), float_scales, torch.tensor(FP4_VALUES),
                                 torch.empty(0), 16, dtype)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], e8m0 scales [N, K / 32]): each block's scale the power
    of two that brings its largest magnitude to at most 448 (for tests and tools)."""
    n, k = w.shape
    blocks = w.float().view(n, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    return scaled.view(n, k).to(torch.float8_e4m3fn), (exp + 127).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> NVFP4 tensors as compressed-tensors writes them: a global scale bringing the
    largest magnitude to 6 x 448, e4m3 scales per 16 inputs, e2m1 codes (for tests and tools)."""
    n, k = w.shape
    w = w.float()
    global_scale = (6.0 * 448.0) / w.abs().amax().clamp(min=1e-12)
    blocks = w.view(n, k // 16, 16)
    scale = (blocks.abs().amax(-1) / 6.0 * global_scale).to(torch.float8_e4m3fn)
    real = scale.float() / global_scale
    scaled = blocks / real.clamp(min=1e-30).unsqueeze(-1)
    grid = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    code = (index + 8 * (scaled < 0)).to(torch.uint8).view(n, k)
    return {"weight_packed": (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous(),
            "weight_scale": scale, "weight_global_scale": global_scale.reshape(1)}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K / 2], e8m0 scales [N, K / 32]): each block's scale the power of
    two that brings its largest magnitude to at most 6, each value rounded to the nearest e2m1
    (the OCP rule; for tests and tools: checkpoints come quantized)."""
    n, k = w.shape
    blocks = w.float().view(n, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    grid = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    code = (index + 8 * (scaled < 0)).to(torch.uint8).view(n, k)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8)


class MXSpec:
    """OCP MX checkpoints: each quantized layer's codes and e8m0 scale bytes [N, K / 32] per
    packed slot, by their names: gpt-oss's MXFP4 (`quant_method: mxfp4`: `mx_blocks`
    [N, K / 32, 16] bytes and `mx_scales`, as the model file names them, apart from GPTQ's
    `scales`) and ModelOpt's MXFP8 (`quant_algo: MXFP8`: `weight`, e4m3 [N, K] as
    float8_e4m3fn or its bytes, and `weight_scale`)."""

    _NAMES = {"mxfp4": ("mx_blocks", "mx_scales", 4), "mxfp8": ("weight", "weight_scale", 8)}

    def __init__(self, qc: dict[str, Any], fmt: str) -> None:
        self.qc, self.fmt = qc, fmt
        self.codes, self.scales, self.bits = self._NAMES[fmt]

    def build(self, parts: list[dict[str, torch.Tensor]], widths: list[int], k: int,
              dtype: torch.dtype) -> MicroscaledPacked:
        codes, scales = [], []
        for part, width in zip(parts, widths):
            if self.codes not in part or self.scales not in part:
                raise ValueError(f"{self.fmt} checkpoint: a quantized layer has {self.codes} and "
                                 f"{self.scales}, got {sorted(part)}")
            c = part[self.codes].reshape(width, -1).view(torch.uint8)
            s = part[self.scales]
            if (tuple(c.shape) != (width, k * self.bits // 8) or s.dtype != torch.uint8
                    or tuple(s.shape) != (width, k // 32)):
                raise ValueError(f"{self.fmt} checkpoint: {self.codes} "
                                 f"{tuple(part[self.codes].shape)} and {self.scales} "
                                 f"{tuple(s.shape)} ({s.dtype}) for a slot of {width} rows x "
                                 f"{k} inputs")
            codes.append(c)
            scales.append(s)
        table = torch.tensor(FP4_VALUES) if self.bits == 4 else e4m3_table()
        return MicroscaledPacked(torch.cat(codes), torch.cat(scales), table, e8m0_table(), 32,
                                 dtype)
