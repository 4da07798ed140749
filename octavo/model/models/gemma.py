"""Gemma 2 and Gemma 3 decoders: local (sliding-window) and global layers interleaved, a norm before
and after each sublayer, (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GeGLU, attention
scaled by query_pre_attn_scalar. Gemma 2 soft-caps attention scores and logits; Gemma 3 instead
normalizes q and k per head and gives its local layers their own RoPE base."""
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
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.layers.norm import GemmaRMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.base import QKV_GATE_UP, CausalLM
from octavo.model.pipeline import is_last_stage, stage_layers


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                     cfg.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = heads_output(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        scalar = cfg.query_pre_attn_scalar or self.head_dim
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=scalar ** -0.5,
                                   sliding_window=cfg.layer_window(layer_index),
                                   softcap=cfg.attn_logit_softcap)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = column_parallel(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                            what="intermediate_size")
        self.down_proj = row_parallel(cfg.intermediate_size, cfg.hidden_size,
                                      what="intermediate_size")
        self.act = gated_act(cfg.hidden_act)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_index, rotary, qk_norm)
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.ONE_PLUS, self.input_layernorm,
                            self.pre_feedforward_layernorm, self.post_attention_layernorm,
                            self.post_feedforward_layernorm)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.hidden_size = cfg.hidden_size
        glob = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings)
        # Rope scaling (long-context Gemma 3) applies to the global layers only.
        local = glob if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_local_theta)
        self.layers = stage_layers(cfg.num_layers, lambda i: GemmaDecoderLayer(
            cfg, i, local if cfg.layer_window(i) else glob, qk_norm))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.decode_stack = None  # octavo/model/decode_stack.py attaches one where it fits
        self.compiled_layers = None  # octavo/model/compiled.py, at compilation levels 1-3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            x = self.embed_tokens(input_ids)
            # The scale is rounded to the model dtype first, as the reference does (55.4 -> 55.5).
            x = x * torch.tensor(self.hidden_size ** 0.5, dtype=x.dtype)
        else:
            x = hidden
        x = run_layers(self.layers, self.decode_stack, x, positions, self.compiled_layers)
        return self.norm(x) if is_last_stage() else x


class Gemma2ForCausalLM(CausalLM):
    packed_modules_mapping = QKV_GATE_UP
    qk_norm = False

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.model = GemmaModel(cfg, max_positions, self.qk_norm)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)
        self.final_logit_softcap = cfg.final_logit_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def checkpoint_name(self, name: str) -> str | None:
        # Gemma3ForConditionalGeneration checkpoints keep the text model under language_model.
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        name = name.replace("model.language_model.", "model.")
        return super().checkpoint_name(name.replace("language_model.", ""))
