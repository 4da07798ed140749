"""Self-attention over the paged KV cache; the step's plan comes from the forward context."""
from __future__ import annotations

import torch
from torch import nn

from octavo.kernels.fused import write_kv
from octavo.kernels.paged_attention import paged_attention
from octavo.model import context_parallel
from octavo.model.context import get_forward_context
from octavo.model.layers.linear import Span
from octavo.model.layers.opaque import call_opaque


class PagedAttention(nn.Module):
    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: Span | None = None,
                 shared_kv: bool = False, chunk: int | None = None) -> None:
        super().__init__()
        # Llama 4's local layers: a query sees only the keys of its own `chunk`-token chunk
        # (the step's chunked plan), else None
        self.chunk = chunk
        self.shared_kv = shared_kv  # K and V are one cache row (MLA: model/kv_spec.py)
        # gpt-oss: a learned logit per query head in each softmax's denominator (`sinks`: this
        # rank's heads among the model's), else None
        self.sinks = None
        if sinks is not None:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.sinks.weight_loader = lambda param, full: param.data.copy_(
                sinks.take(full, 0, "self_attn.sinks"))
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # An fp8 KV cache stores k / k_scale and v / v_scale: a checkpoint's calibrated
        # self_attn.k_scale / v_scale when it has them, else 1 (values saturate at +-448).
        self.k_scale = self.v_scale = 1.0

    def set_kv_scale(self, name: str, value: torch.Tensor) -> None:
        if self.shared_kv:
            raise NotImplementedError(f"{name}: this layer caches one row a token as both K and "
                                      f"V (latent attention); k/v cache scales do not apply")
        if name not in ("k_scale", "v_scale") or value.numel() != 1 or not value.item() > 0:
            raise ValueError(f"{name}: a KV-cache scale must be one positive number, "
                             f"got shape {tuple(value.shape)}")
        setattr(self, name, float(value.item()))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H * D]"""
        return call_opaque(self, q, k, v)  # compiled graphs call it whole

    def empty_output(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    def eager_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_index]
        ks, vs = ((self.k_scale, self.v_scale) if cache.dtype == torch.float8_e4m3fn
                  else (1.0, 1.0))
        if ctx.context_parallel is not None:
            if self.sinks is not None or self.chunk is not None:
                raise NotImplementedError("attention sinks and chunked local attention under "
                                          "context parallelism")
            out = context_parallel.attention(ctx.context_parallel, q, k, v, cache, self.scale,
                                             self.softcap, self.sliding_window, ks, vs)
            return out.reshape(q.shape[0], -1)
        plan = ctx.plan
        if self.sliding_window and ctx.sliding_plan:
            plan = ctx.sliding_plan
        elif self.chunk is not None:
            plan = ctx.chunked_plan
        write_kv(cache, k, v, plan.slot_mapping, ks, vs)
        out = paged_attention(q, cache, plan, self.scale, self.softcap, ks, vs, self.sinks)
        return out.reshape(q.shape[0], -1)
