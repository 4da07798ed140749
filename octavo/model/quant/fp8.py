"""FP8 (e4m3) weights: `quant_method: fp8`, compressed-tensors' float-quantized checkpoints and
FBGEMM's (`fbgemm_fp8`: a scale per output row; Llama 4 Maverick's FP8 release, whose stacked
experts' `<projection>_scale` models/moe.py's StackedExperts splits per expert), and
--quantization fp8.

A layer holds `weight` float8_e4m3fn [N, K] and `weight_scale`: one value (per tensor), [N] or
[N, 1] (per channel), or `weight_scale_inv` [N / b, K / b] for block-wise checkpoints
(`weight_block_size`); w = fp8 * scale. An `input_scale` or FBGEMM's `activation_scale_ub`
(activation quantization) is ignored: activations stay in bf16/fp32, which is at least as
accurate.

The weights stay FP8: their bytes and a float32 scale per row and block
(quant/microscaled.py), a byte a weight, half of bf16. CPUs have no FP8 math: the kernel turns
eight codes at a time into float32 with integer operations (AVX2) as it multiplies; on an AMD
EPYC with AVX2 only that beat the dense float32 and bf16 weights at every batch (docs/usage.md).
"""
from __future__ import annotations

from typing import Any

import torch

from octavo.model.quant.microscaled import MicroscaledPacked, fp8_packed

FP8_MAX = 448.0  # largest float8_e4m3fn


def _row_scales(part: dict[str, torch.Tensor], width: int, k: int,
                block: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One slot's e4m3 weight [width, K] and its scales as float32 [width, K / b], with b."""
    if "weight" not in part:
        raise ValueError(f"fp8 checkpoint lacks 'weight' for a quantized layer (has "
                         f"{sorted(part)})")
    w = part["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"fp8 weights of dtype {w.dtype}: octavo keeps "
                                  f"float8_e4m3fn weights (the e4m3 FP8 format)")
    if w.shape != (width, k):
        raise ValueError(f"fp8 weight shape {tuple(w.shape)}, layer slot {(width, k)}")
    if "weight_scale_inv" in part:  # block-wise: one scale per [b0, b1] block
        if not block:
            raise ValueError("fp8 checkpoint has weight_scale_inv but quantization_config has no "
                             "weight_block_size")
        s = part["weight_scale_inv"].float()
        return w, s.repeat_interleave(block[0], 0)[:width], block[1]
    if "weight_scale" not in part:
        raise ValueError(f"fp8 checkpoint lacks 'weight_scale' (has {sorted(part)})")
    s = part["weight_scale"].float()
    if s.numel() == 1:
        return w, s.reshape(1, 1).expand(width, 1), k
    if s.numel() == width:
        return w, s.reshape(width, 1), k
    raise ValueError(f"fp8 weight_scale must be per tensor or per output channel ({width}), "
                     f"got shape {tuple(s.shape)}")


class FP8Spec:
    """The quantization_config of an fp8 or compressed-tensors (float, 8-bit) checkpoint."""

    def __init__(self, fmt: str, qc: dict[str, Any]) -> None:
        self.fmt = fmt
        self.block = qc.get("weight_block_size")
        if fmt == "compressed-tensors":
            groups = qc.get("config_groups") or {}
            for name, group in groups.items():
                weights = (group or {}).get("weights") or {}
                if weights.get("type") != "float" or weights.get("num_bits") != 8:
                    raise NotImplementedError(
                        f"quantization_config.config_groups.{name}.weights: only 8-bit float "
                        f"(FP8) compressed-tensors checkpoints are supported, got "
                        f"type={weights.get('type')!r} num_bits={weights.get('num_bits')!r}")
                if weights.get("strategy") == "block":
                    self.block = weights.get("block_structure")
                elif weights.get("strategy") not in (None, "tensor", "channel"):
                    raise NotImplementedError(
                        f"quantization_config.config_groups.{name}.weights.strategy="
                        f"{weights.get('strategy')!r}: supported: tensor, channel, block")

    def build(self, parts: list[dict[str, torch.Tensor]], widths: list[int], k: int,
              dtype: torch.dtype) -> MicroscaledPacked:
        slots = [_row_scales(p, w, k, self.block) for p, w in zip(parts, widths)]
        # the slots' scales to one block size (a per-row scale repeats across the blocks)
        block = min(b for _, _, b in slots)
        if k % block or block % 16 or any(b % block for _, _, b in slots):
            raise NotImplementedError(
                f"fp8 weights of {k} inputs with scale blocks of {sorted({b for *_, b in slots})}"
                f": octavo's FP8 kernel takes blocks that are multiples of 16 inputs")
        scales = torch.cat([s.repeat_interleave(b // block, 1) for _, s, b in slots])
        return fp8_packed(torch.cat([w for w, _, _ in slots]), scales, block, dtype)


def dequantize_fp8(part: dict[str, torch.Tensor], block: list[int] | None) -> torch.Tensor:
    """An FP8 weight [N, K] with its scales (any of the forms above) as float32: for a weight an
    algorithm reads whole rather than multiplies (DeepSeek's kv_b_proj, whose heads'
    projections are absorbed into the queries)."""
    n, k = part["weight"].shape
    w8, scales, b = _row_scales(part, n, k, block)
    return w8.float() * scales.repeat_interleave(b, 1)[:, :k]


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype) -> MicroscaledPacked | torch.Tensor:
    """--quantization fp8: e4m3 per output channel, kept as FP8 (a layer whose inputs do not
    come in 16s stays in `dtype`, rounded as FP8 would)."""
    w = w.float()
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    w8 = (w / scale).to(torch.float8_e4m3fn)
    if w.shape[1] % 16:
        return (w8.float() * scale).to(dtype)
    return fp8_packed(w8, scale, w.shape[1], dtype)
