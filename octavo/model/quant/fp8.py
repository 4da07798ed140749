"""FP8 (e4m3) weights: `quant_method: fp8` and compressed-tensors' float-quantized checkpoints,
and --quantization fp8.

A layer holds `weight` float8_e4m3fn [N, K] and `weight_scale`: one value (per tensor), [N] or
[N, 1] (per channel), or `weight_scale_inv` [N / b, K / b] for block-wise checkpoints
(`weight_block_size`); w = fp8 * scale. An `input_scale` (activation quantization) is ignored:
activations stay in bf16/fp32, which is at least as accurate.

CPUs without FP8 math gain nothing by keeping the bytes: converting fp8 to bf16 on every step
costs more than reading bf16 (torch's conversion is scalar; measured in docs/usage.md), so the
weights are dequantized once at load into the model dtype and run as dense weights. Memory is that
of bf16; the outputs are the FP8 model's.
"""
from __future__ import annotations

from typing import Any

import torch

FP8_MAX = 448.0  # largest float8_e4m3fn


def _dequantize(part: dict[str, torch.Tensor], width: int, k: int,
                block: list[int] | None) -> torch.Tensor:
    if "weight" not in part:
        raise ValueError(f"fp8 checkpoint lacks 'weight' for a quantized layer (has {sorted(part)})")
    w = part["weight"].float()
    if w.shape != (width, k):
        raise ValueError(f"fp8 weight shape {tuple(w.shape)}, layer slot {(width, k)}")
    if "weight_scale_inv" in part:  # block-wise: one scale per [b0, b1] block
        if not block:
            raise ValueError("fp8 checkpoint has weight_scale_inv but quantization_config has no "
                             "weight_block_size")
        s = part["weight_scale_inv"].float()
        s = s.repeat_interleave(block[0], 0)[:width].repeat_interleave(block[1], 1)[:, :k]
        return w * s
    if "weight_scale" not in part:
        raise ValueError(f"fp8 checkpoint lacks 'weight_scale' (has {sorted(part)})")
    s = part["weight_scale"].float()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == width:
        return w * s.reshape(width, 1)
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
              dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([_dequantize(p, w, k, self.block) for p, w in zip(parts, widths)]) \
            .to(dtype)


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """--quantization fp8: e4m3 per output channel, returned dequantized in `dtype`."""
    w = w.float()
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(dtype)
