"""GPT-NeoX (Pythia): LayerNorm with bias, fused per-head q/k/v, partial rotary, and attention and
MLP reading the same input in parallel (use_parallel_residual)."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.decode_stack import run_layers
from octavo.model.layer_spec import LayerSpec, NormKind, plain_activation
from octavo.model.layers.activation import activation
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.embedding import Embedding
from octavo.model.layers.linear import (
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.layers.rotary import RotaryEmbedding, make_rotary
from octavo.model.models.base import CausalLM
from octavo.model.pipeline import is_last_stage, stage_layers


class NeoXAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, _ = local_heads(cfg.num_heads, cfg.num_heads)
        self.head_dim = cfg.head_dim
        self.query_key_value = qkv_parallel(cfg.hidden_size, self.head_dim, cfg.num_heads,
                                            cfg.num_heads, bias=cfg.attention_bias)
        self.dense = heads_output(self.head_dim, cfg.num_heads, cfg.num_heads, cfg.hidden_size,
                                  bias=cfg.attention_bias)
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_heads, self.head_dim,
                                   scale=self.head_dim ** -0.5)


class NeoXMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = column_parallel(cfg.hidden_size, [cfg.intermediate_size],
                                             bias=True, what="intermediate_size")
        self.dense_4h_to_h = row_parallel(cfg.intermediate_size, cfg.hidden_size, bias=True,
                                          what="intermediate_size")
        self.hidden_act = cfg.hidden_act
        self.act = activation(cfg.hidden_act)


class NeoXLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.parallel = cfg.extra.get("use_parallel_residual", True)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = NeoXAttention(cfg, layer_index, rotary)
        self.mlp = NeoXMLP(cfg)

    def spec(self) -> LayerSpec:
        a, mlp = self.attention, self.mlp
        return LayerSpec(
            NormKind.LAYER, self.input_layernorm, None, self.post_attention_layernorm, None,
            None, None, a.query_key_value, a.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h,
            plain_activation(mlp.hidden_act), a.attn, a.rotary, a.attn.scale, None, None,
            gated=False, parallel_residual=self.parallel, act=mlp.act)


class NeoXModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_in = Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = make_rotary(cfg.head_dim, cfg.rotary_dim or cfg.head_dim, max_positions,
                             cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.layers = stage_layers(cfg.num_layers, lambda i: NeoXLayer(cfg, i, rotary))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.decode_stack = None  # octavo/model/decode_stack.py attaches one where it fits
        self.compiled_layers = None  # octavo/model/compiled.py, at compilation levels 1-3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_in(input_ids) if hidden is None else hidden
        x = run_layers(self.layers, self.decode_stack, x, positions, self.compiled_layers)
        return self.final_layer_norm(x) if is_last_stage() else x


class GPTNeoXForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.model = NeoXModel(cfg, max_positions)
        self.lm_head = self.make_lm_head(self.model.embed_in)

    def checkpoint_name(self, name: str) -> str | None:
        name = name.replace("gpt_neox.", "model.", 1).replace("embed_out.", "lm_head.", 1)
        if name.endswith((".attention.bias", ".attention.masked_bias")):
            return None  # causal-mask buffers of old checkpoints
        return super().checkpoint_name(name)

    def convert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".query_key_value." in name:
            # Rows are [head][q|k|v][head_dim]; the packed layer wants [q|k|v][head][head_dim].
            heads, rest = self.cfg.num_heads, tensor.shape[1:]
            return tensor.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)
        return tensor
