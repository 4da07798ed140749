"""GPTQ and AWQ checkpoints: their int32-packed codes unpacked and repacked for octavo's kernels.

GPTQ (AutoGPTQ / GPTQModel / transformers), per linear layer with K inputs and N outputs:
- `qweight` int32 [K * bits / 32, N]: 32 / bits codes per word along the inputs, lowest bits first;
- `qzeros` int32 [G, N * bits / 32]: zero points per group, packed along the outputs; the classic
  format ("gptq", v1) stores zero - 1, `checkpoint_format: gptq_v2` the zero itself;
- `scales` float16 [G, N]; `g_idx` int32 [K]: each input's group (act-order, `desc_act`: not
  k // group_size). w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].
AWQ (AutoAWQ "gemm" layout): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8] both packed
along the outputs in the interleaved order 0 2 4 6 1 3 5 7 (word nibble i holds output column
ORDER[i] of its 8), `scales` [G, N]; w = scales * (q - zero), groups of consecutive inputs.

Act-order groups are made contiguous by sorting the inputs by group: the packed weight keeps
that permutation and applies it to x. Slots packed into one layer (q/k/v) must share it, as GPTQ
gives them (they quantize the same input).
"""
from __future__ import annotations

from typing import Any

import torch

from octavo.model.quant.packed import Int4Packed, Int8Packed, PackedWeight

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_UNDO = [_AWQ_ORDER.index(c) for c in range(8)]  # output column c sits in nibble _AWQ_UNDO[c]


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits codes per word down the rows -> [R * 32 / bits, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
    return codes.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits codes per word along the columns -> [R, C * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    return codes.reshape(packed.shape[0], -1)


def _need(part: dict[str, torch.Tensor], name: str, fmt: str) -> torch.Tensor:
    if name not in part:
        raise ValueError(f"{fmt} checkpoint lacks {name!r} for a quantized layer "
                         f"(has {sorted(part)})")
    return part[name]


class GPTQSpec:
    """The quantization_config fields that say how to read a GPTQ or AWQ layer."""

    def __init__(self, fmt: str, qc: dict[str, Any]) -> None:
        self.fmt = fmt
        self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if fmt == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise NotImplementedError(
                    f"quantization_config.version={version!r}: only AWQ's gemm layout is supported")
            if self.bits != 4:
                raise ValueError(f"quantization_config.bits must be 4 for AWQ, got {self.bits}")
            self.zero_offset = 0
        else:
            if self.bits not in (4, 8):
                raise NotImplementedError(
                    f"quantization_config.bits={self.bits}: GPTQ is supported with 4 or 8 bits")
            fmt_name = qc.get("checkpoint_format", "gptq")
            if fmt_name not in ("gptq", "gptq_v2"):
                raise NotImplementedError(f"quantization_config.checkpoint_format={fmt_name!r}: "
                                          "supported: gptq, gptq_v2")
            self.zero_offset = 1 if fmt_name == "gptq" else 0

    def codes(self, part: dict[str, torch.Tensor], width: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One slot -> (q [N, K], scale [N, G], zero [N, G], g_idx [K])."""
        qweight = _need(part, "qweight", self.fmt)
        qzeros = _need(part, "qzeros", self.fmt)
        scales = _need(part, "scales", self.fmt).float()  # [G, N]
        group = k if self.group_size == -1 else self.group_size
        if self.fmt == "awq":
            q = unpack_cols(qweight, 4).reshape(k, -1, 8)[..., _AWQ_UNDO].reshape(k, -1)
            z = unpack_cols(qzeros, 4).reshape(qzeros.shape[0], -1, 8)[..., _AWQ_UNDO]
            z = z.reshape(qzeros.shape[0], -1)
            g_idx = torch.arange(k) // group
        else:
            q = unpack_rows(qweight, self.bits)
            z = unpack_cols(qzeros, self.bits) + self.zero_offset
            g_idx = part.get("g_idx")
            g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
        if q.shape != (k, width) or scales.shape[1] != width:
            raise ValueError(f"{self.fmt} layer of {k} inputs and {width} outputs: qweight "
                             f"unpacks to {tuple(q.shape)}, scales are {tuple(scales.shape)}")
        return q.t(), scales.t(), z[:, :width].t().float(), g_idx

    def build(self, parts: list[dict[str, torch.Tensor]], widths: list[int], k: int,
              dtype: torch.dtype) -> PackedWeight:
        slots = [self.codes(p, w, k) for p, w in zip(parts, widths)]
        g_idx = slots[0][3]
        if any(not torch.equal(s[3], g_idx) for s in slots[1:]):
            raise ValueError(f"{self.fmt}: the packed slots of one layer (q/k/v or gate/up) have "
                             "different g_idx; octavo needs one input order per layer")
        q = torch.cat([s[0] for s in slots])
        scale, zero = torch.cat([s[1] for s in slots]), torch.cat([s[2] for s in slots])
        num_groups = scale.shape[1]
        group = k // num_groups
        perm = None
        if not torch.equal(g_idx, torch.arange(k) // group):  # act-order: sort inputs by group
            counts = torch.bincount(g_idx, minlength=num_groups)
            if k % num_groups or counts.numel() != num_groups or (counts != group).any():
                raise ValueError(f"{self.fmt}: g_idx does not give every one of the {num_groups} "
                                 f"groups {k // max(num_groups, 1)} inputs")
            perm = torch.argsort(g_idx, stable=True)
            q = q[:, perm]
        if self.bits == 4:
            return Int4Packed(q, scale, zero, group, dtype, perm)
        return Int8Packed(q, scale, zero, group, dtype, perm)
