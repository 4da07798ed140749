"""Self-attention over the paged KV cache; the step's plan comes from the forward context."""
from __future__ import annotations

import torch
from torch import nn

from octavo.kernels.fused import write_kv
from octavo.kernels.paged_attention import paged_attention
from octavo.model.context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H * D]"""
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_index]
        plan = ctx.sliding_plan if self.sliding_window and ctx.sliding_plan else ctx.plan
        write_kv(cache, k, v, plan.slot_mapping)
        out = paged_attention(q, cache, plan, self.scale, self.softcap)
        return out.reshape(q.shape[0], -1)
