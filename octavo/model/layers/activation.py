"""Activations: plain ones, and gated ones on a packed [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels.fused import gelu_tanh_and_mul, silu_and_mul

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported; supported: "
                                  f"{', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def gated_act(name: str):
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported")
    if name == "silu":
        return silu_and_mul
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return gelu_tanh_and_mul
    act = _ACTIVATIONS[name]

    def act_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return act_and_mul


class ClampedSwiGLU:
    """gpt-oss's gated activation on a packed [gate | up] projection: gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). The fused
    decode stack computes the same ops (csrc/decode_stack.h, activate)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
