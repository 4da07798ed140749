"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3): RMSNorm, GQA with RoPE,
SwiGLU. Qwen3 also RMS-normalizes q and k per head before RoPE; Phi-3 checkpoints store q/k/v and
gate/up already packed (the names match), with longrope and possibly partial rotary."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.decode_stack import run_layers
from octavo.model.layer_spec import LayerSpec, NormKind, decoder_spec
from octavo.model.layers.activation import gated_act
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.embedding import Embedding
from octavo.model.layers.linear import (
    Linear,
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, make_rotary
from octavo.model.models.base import QKV_GATE_UP, CausalLM
from octavo.model.pipeline import is_last_stage, stage_layers


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                     cfg.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = heads_output(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=self.head_dim ** -0.5,
                                   sliding_window=cfg.layer_window(layer_index))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = column_parallel(cfg.hidden_size, [width] * 2, what="intermediate_size")
        self.down_proj = row_parallel(width, cfg.hidden_size, what="intermediate_size")
        self.act = gated_act(cfg.hidden_act)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qk_norm)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.RMS, self.input_layernorm,
                            self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (built by the family: dense or mixture of experts), RMSNorm."""

    def __init__(self, cfg: ArchConfig, layers: nn.ModuleList) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.decode_stack = None  # octavo/model/decode_stack.py attaches one where it fits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        x = run_layers(self.layers, self.decode_stack, x, positions)
        return self.norm(x) if is_last_stage() else x


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = QKV_GATE_UP
    qk_norm = False

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        rotary = make_rotary(cfg.head_dim, cfg.rotary_dim or cfg.head_dim, max_positions,
                             cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.model = LlamaModel(cfg, stage_layers(
            cfg.num_layers, lambda i: LlamaDecoderLayer(cfg, i, rotary, self.qk_norm)))
        self.lm_head = self.make_lm_head(self.model.embed_tokens)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder with a classifier over its last token instead of an LM head (`score`, no
    bias: Llama's, Mistral's and Qwen's *ForSequenceClassification): it classifies and scores,
    it does not generate."""

    classifier_token = "last"  # what the head reads (model/pooler.py)

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        del self.lm_head
        self.score = Linear(cfg.hidden_size, [cfg.num_labels])

    def classify(self, last_states: torch.Tensor) -> torch.Tensor:
        return self.score(last_states.to(self.dtype)).float()


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
