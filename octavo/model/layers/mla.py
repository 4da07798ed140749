"""DeepSeek's multi-head latent attention (MLA), a layer's attention as a module of its own
(`LayerSpec.mixer`; model/models/deepseek.py explains the method): the latent row a token is all
the KV cache holds, and attention runs on it with each head's key projection absorbed into its
query and its value projection applied to the output."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.linear import (
    Linear,
    Span,
    column_parallel,
    head_share,
    local_heads,
    row_parallel,
)
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, yarn_mscale


class _HeadRows(nn.Module):
    """A weight read whole by the latent attention (kv_b_proj: each head's W_UK and W_UV): not a
    Linear, so no quantization takes it (an FP8 checkpoint's is dequantized as it is read, as
    the model file's load_weights does); tensor parallelism keeps this rank's heads' rows."""

    reads_dequantized = True  # quantized checkpoint tensors of it are the model file's to decode

    def __init__(self, rows: Span, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows.width, in_features), requires_grad=False)
        self.weight.weight_loader = lambda param, full: param.data.copy_(
            rows.take(full, 0, "kv_b_proj"))


class MlaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        heads = cfg.num_heads
        self.num_heads, _ = local_heads(heads, heads)
        first = head_share(heads, heads).q_first  # every head is a KV head (latent)
        self.nope, self.rope = cfg.required("qk_nope_head_dim"), cfg.required("qk_rope_head_dim")
        self.v_dim, self.rank = cfg.required("v_head_dim"), cfg.required("kv_lora_rank")
        q_dim = self.nope + self.rope
        bias = cfg.attention_bias
        self.q_lora_rank = cfg.extra.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, [self.q_lora_rank], bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = column_parallel(self.q_lora_rank, [heads * q_dim],
                                            what="num_attention_heads")
        else:
            self.q_proj = column_parallel(cfg.hidden_size, [heads * q_dim],
                                          what="num_attention_heads")
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, [self.rank + self.rope], bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        kv_dim = self.nope + self.v_dim
        self.kv_b_proj = _HeadRows(Span(first * kv_dim, self.num_heads * kv_dim, heads * kv_dim),
                                   self.rank)
        self.o_proj = row_parallel(heads * self.v_dim, cfg.hidden_size, bias=bias,
                                   what="num_attention_heads")
        self.rotary = rotary
        scale = q_dim ** -0.5
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get(
                "mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.attn = PagedAttention(layer_index, self.num_heads, 1, self.rank + self.rope,
                                   scale=scale, shared_kv=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x).contiguous())) if self.q_lora_rank
             else self.q_proj(x)).view(t, h, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary(positions, q_rope.contiguous(),
                                     k_rope.contiguous().view(t, 1, self.rope))
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [h, nope, rank], [h, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        row = torch.cat([latent, k_rope.view(t, self.rope)], -1).view(t, 1, -1)
        out = self.attn(torch.cat([q_latent, q_rope.view(t, h, self.rope)], -1), row, row)
        out = out.view(t, h, self.rank + self.rope)[..., :self.rank]
        return self.o_proj(torch.einsum("thr,hvr->thv", out, w_uv).reshape(t, h * self.v_dim))
