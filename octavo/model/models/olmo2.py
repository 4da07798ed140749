"""OLMo 2 (AI2): Llama's projections with the norms moved after each sublayer (x + norm(attn(x)),
x + norm(mlp(x)), none before), and q and k RMS-normalized over all of a token's heads at once
before RoPE."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, NormKind, decoder_spec
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qk_norm=True,
                                        qk_norm_whole=True)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.RMS, None, None,
                            self.post_attention_layernorm, self.post_feedforward_layernorm)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return Olmo2DecoderLayer(cfg, layer_index, rotary)
