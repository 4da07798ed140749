"""GLM (GLM-4 9B as GlmForCausalLM) and GLM-4 (0414, Glm4ForCausalLM): Llama's layers with
gate_up stored packed, q/k/v biases without an o bias, and RoPE on adjacent feature pairs of the
first half of each head (partial_rotary_factor, 0.5 unless config.json says; reordered at load:
LlamaForCausalLM.pairwise_rope). GLM-4 adds a norm after each sublayer (Gemma's sandwich, of
RMSNorms)."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, NormKind, decoder_spec
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GlmDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 sandwich: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, o_bias=False)
        self.mlp = LlamaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_self_attn_layernorm = RMSNorm(h, eps) if sandwich else None
        self.post_mlp_layernorm = RMSNorm(h, eps) if sandwich else None

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.RMS, self.input_layernorm,
                            self.post_attention_layernorm, self.post_self_attn_layernorm,
                            self.post_mlp_layernorm)


class GlmForCausalLM(LlamaForCausalLM):
    pairwise_rope = True
    sandwich = False

    def rotary_dim(self, cfg: ArchConfig) -> int:
        given = ((cfg.extra.get("rope_parameters") or {}).get("partial_rotary_factor")
                 or cfg.extra.get("partial_rotary_factor"))
        return int(cfg.head_dim * (given or 0.5))

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return GlmDecoderLayer(cfg, layer_index, rotary, self.sandwich)


class Glm4ForCausalLM(GlmForCausalLM):
    sandwich = True
