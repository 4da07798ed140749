"""RMSNorm (plain and Gemma's 1 + w) and a per-head LayerNorm (Cohere's q/k norms), computed in
float32 as the reference implementations do."""
from __future__ import annotations

import torch
from torch import nn

from octavo.kernels.fused import one_plus_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class UnitRMSNorm(RMSNorm):
    """x / rms(x) without a learned weight (Llama 4's q/k norm): a weight of ones that no
    checkpoint tensor fills."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)
        self.eps = eps


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w), multiplied in float32 before the cast back (Gemma's order)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps
        self._plus_one: tuple[tuple[int, int], torch.Tensor] | None = None

    def plus_one(self) -> torch.Tensor:
        """1 + w in float32, as it is applied (here and in the decode stack); made once per
        loaded weight."""
        if torch.compiler.is_compiling():  # a graph computes it in place and keeps no state
            return 1.0 + self.weight.float()
        key = (self.weight.data_ptr(), self.weight._version)
        if self._plus_one is None or self._plus_one[0] != key:
            self._plus_one = key, 1.0 + self.weight.float()
        return self._plus_one[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return one_plus_rms_norm(x, self.plus_one(), self.eps)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's features, without a bias, with a weight per head ([heads,
    head_dim]), in float32 and rounded once (Cohere's q/k norms)."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]"""
        xf = x.float()
        xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)
