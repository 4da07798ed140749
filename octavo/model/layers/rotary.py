"""Rotary position embeddings (rotate-half layout) with the common scaling variants, over the
whole head or its first `rotary_dim` features."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from octavo.kernels.fused import rotary


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude for a context stretched `scale` times (DeepSeek also scales its softmax
    by the square of this with its mscale_all_dim)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict[str, Any],
          max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: each frequency interpolated
    (divided by the factor) below the correction range, kept above it, blended linearly
    between; cos and sin scaled by the attention factor (DeepSeek's mscale ratio where given).
    `max_positions`: the config's, the original context where the scaling does not name it."""
    original = s.get("original_max_position_embeddings") or max_positions
    factor = s.get("factor") or max_positions / original

    magnitude = s.get("attention_factor")
    if magnitude is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        magnitude = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                     else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = _inv_freq(dim, base)
    kept = 1 - ramp  # the share of each frequency kept as it is
    return extrapolated / factor * (1 - kept) + extrapolated * kept, float(magnitude)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: dict[str, Any] | None = None,
                 original_max_positions: int | None = None) -> None:
        super().__init__()
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        position_scale = magnitude = 1.0
        if kind == "default":
            inv_freq = _inv_freq(head_dim, base)
        elif kind == "linear":
            inv_freq = _inv_freq(head_dim, base)
            position_scale = 1.0 / scaling["factor"]
        elif kind == "dynamic":
            # transformers rescales the base by the current length once it passes the original
            # context; a paged cache needs one fixed table, so the base is the one for the
            # longest context served: identical to transformers up to the original length.
            factor = scaling["factor"]
            original = scaling.get("original_max_position_embeddings") or original_max_positions
            if max_positions > original:
                growth = factor * max_positions / original - (factor - 1)
                base = base * growth ** (head_dim / (head_dim - 2))
            inv_freq = _inv_freq(head_dim, base)
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(_inv_freq(head_dim, base), scaling)
        elif kind == "freq_factors":  # a GGUF's rope_freqs: each frequency divided by its factor
            factors = scaling["freq_factors"]
            if len(factors) != head_dim // 2:
                raise ValueError(f"rope_freqs: {len(factors)} factors given, head_dim / 2 = "
                                 f"{head_dim // 2} needed")
            inv_freq = _inv_freq(head_dim, base) / torch.tensor(factors, dtype=torch.float64)
        elif kind == "yarn":
            inv_freq, magnitude = _yarn(head_dim, base, scaling,
                                        original_max_positions or max_positions)
        elif kind == "longrope":
            # transformers picks the long factors when the sequence in a call passes the original
            # context, the short ones otherwise; one fixed table takes the long ones when the
            # context served passes it: identical whenever every sequence is on the same side.
            original = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or (original_max_positions or original) / original
            ext = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
            if len(ext) != head_dim // 2:
                raise ValueError(f"longrope factors: {len(ext)} given, head_dim / 2 = "
                                 f"{head_dim // 2} needed")
            inv_freq = _inv_freq(head_dim, base) / torch.tensor(ext, dtype=torch.float64)
            magnitude = scaling.get("attention_factor") or (
                1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
        else:
            raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")
        positions = torch.arange(max_positions, dtype=torch.float64) * position_scale
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", (freqs.cos() * magnitude).float(),  # [P, head_dim / 2]
                             persistent=False)
        self.register_buffer("sin", (freqs.sin() * magnitude).float(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._step_angles: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], rotated at `positions` [T] (in place where the kernel
        runs)."""
        if torch.compiler.is_compiling():  # a graph keeps no state from step to step
            return rotary(positions, q, k, self.cos, self.sin, self._angles(positions))
        # One instance serves every layer: look the step's angles up once, not once per layer.
        if self._positions is not positions:
            self._positions = positions
            self._step_angles = self._angles(positions)
        return rotary(positions, q, k, self.cos, self.sin, self._step_angles)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first `rotary_dim` features of each head; the rest pass through (GPT-NeoX,
    Phi-3 with partial_rotary_factor < 1)."""

    def __init__(self, rotary_dim: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(rotary_dim, *args, **kwargs)
        self.rotary_dim = rotary_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rotary_dim
        qr, kr = super().forward(positions, q[..., :d].contiguous(), k[..., :d].contiguous())
        return torch.cat([qr, q[..., d:]], -1), torch.cat([kr, k[..., d:]], -1)


def pairs_to_halves(tensor: torch.Tensor, head_dim: int, rotary_dim: int,
                    offset: int = 0) -> torch.Tensor:
    """q or k projection rows (a weight's, a bias's or a per-head norm's, heads of `head_dim`
    along dim 0) of a model that rotates adjacent feature pairs (2i, 2i + 1) (GPT-J's layout:
    Cohere, GLM, DeepSeek) reordered so that rotate-half RoPE computes the same: the
    `rotary_dim` features of each head from `offset` become their even ones, then their odd
    ones. q and k are reordered alike, so their products, the attention scores, do not change
    (v is not touched); the KV cache holds keys in this order."""
    evens = torch.arange(offset, offset + rotary_dim, 2)
    head = torch.cat([torch.arange(offset), evens, evens + 1,
                      torch.arange(offset + rotary_dim, head_dim)])
    heads = tensor.shape[0] // head_dim
    order = (torch.arange(heads).unsqueeze(1) * head_dim + head).reshape(-1)
    return tensor.index_select(0, order)


class QueryTemperature(nn.Module):
    """Llama 4's layers without RoPE: the queries scaled by log(floor((p + 1) / floor_scale)
    + 1) * attn_scale + 1 at position p, the keys left as they are, in a rotary's place."""

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
        return (q * (scale * self.attn_scale + 1.0)[:, None, None]).to(q.dtype), k


def make_rotary(head_dim: int, rotary_dim: int, max_positions: int, base: float,
                scaling: dict[str, Any] | None = None,
                original_max_positions: int | None = None) -> RotaryEmbedding:
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dimension must be even and in (0, {head_dim}], got {rotary_dim}")
    if rotary_dim == head_dim:
        return RotaryEmbedding(head_dim, max_positions, base, scaling, original_max_positions)
    return PartialRotaryEmbedding(rotary_dim, max_positions, base, scaling, original_max_positions)
