"""The Python execution of a decoder layer: every family's layer builds its modules and describes
them (`spec()`, model/layer_spec.py), and runs that description op by op here. The fused decode
stack (model/decode_stack.py) is the other execution of the same description, so a layer is
written once and both paths compute it alike."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.model.layer_spec import LayerSpec, MoeSpec


class DecoderLayer(nn.Module):
    """A family's decoder layer: its modules, and `spec()` describing them."""

    _spec: LayerSpec | None = None

    def spec(self) -> LayerSpec:
        raise NotImplementedError(f"{type(self).__name__} does not describe its layer")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return run_layer(self.described(), positions, x)

    def described(self) -> LayerSpec:
        """The layer's description, made once, after loading: the spec holds the modules, which
        keep their identity while their weights are set, quantized or packed."""
        if self._spec is None:
            self._spec = self.spec()
        return self._spec


def run_layer(spec: LayerSpec, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] at `positions` [T] -> the layer's output."""
    h = _scaled(spec, _norm(spec.attn_out_norm,
                            attention(spec, positions, _norm(spec.attn_in_norm, x))))
    if spec.parallel_residual:
        return x + h + _scaled(spec, mlp(spec, _norm(spec.mlp_in_norm, x)))
    x = x + h
    return x + _scaled(spec, _norm(spec.mlp_out_norm, mlp(spec, _norm(spec.mlp_in_norm, x))))


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _scaled(spec: LayerSpec, h: torch.Tensor) -> torch.Tensor:
    return h if spec.residual_scale == 1.0 else h * spec.residual_scale


def attention(spec: LayerSpec, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if spec.mixer is not None:
        return spec.mixer(positions, x)
    t, a = x.shape[0], spec.attention
    q, k, v = spec.qkv(x).split(spec.qkv.shards, dim=-1)
    if spec.output_gate:  # each head's query, then its gate
        q, gate = q.view(t, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
        q = q.reshape(t, -1)
    if spec.q_norm is not None and spec.qk_norm_whole:
        q, k = spec.q_norm(q), spec.k_norm(k)
    q = q.view(t, a.num_heads, a.head_dim)
    k = k.view(t, a.num_kv_heads, a.head_dim)
    if spec.q_norm is not None and not spec.qk_norm_whole:
        q, k = spec.q_norm(q), spec.k_norm(k)
    if spec.rotary is not None:
        q, k = spec.rotary(positions, q, k)
    out = a(q, k, v.view(t, a.num_kv_heads, a.head_dim))
    if spec.output_gate:
        out = out * torch.sigmoid(gate.reshape(t, -1))
    return spec.o(out)


def mlp(spec: LayerSpec, x: torch.Tensor) -> torch.Tensor:
    if spec.moe is not None:
        return mixture(spec.moe, spec, x)
    return spec.down(spec.act(spec.gate_up(x)))


def mixture(moe: MoeSpec, spec: LayerSpec, x: torch.Tensor) -> torch.Tensor:
    """The routed experts, plus the shared expert, gated by a sigmoid (Qwen2-MoE) or not
    (DeepSeek)."""
    out = moe.fused(x, moe.router(x))
    if moe.shared_gate_up is not None:
        shared = moe.shared_down(spec.act(moe.shared_gate_up(x)))
        gate = 1.0 if moe.shared_gate is None else F.sigmoid(moe.shared_gate(x))
        out = out + gate * shared
    return out
