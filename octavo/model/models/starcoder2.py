"""StarCoder 2 (BigCode): Llama's attention (grouped-query, RoPE, an optional sliding window)
with LayerNorms that have biases, a plain GELU(tanh) MLP (c_fc, c_proj) and biases on every
projection (use_bias)."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, NormKind, plain_activation
from octavo.model.layers.activation import activation
from octavo.model.layers.linear import column_parallel, row_parallel
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, bias: bool) -> None:
        super().__init__()
        self.c_fc = column_parallel(cfg.hidden_size, [cfg.intermediate_size], bias=bias,
                                    what="intermediate_size")
        self.c_proj = row_parallel(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                   what="intermediate_size")
        self.hidden_act = cfg.hidden_act
        self.act = activation(cfg.hidden_act)


class Starcoder2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        bias = _use_bias(cfg)
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qkv_bias=bias, o_bias=bias)
        self.mlp = Starcoder2MLP(cfg, bias)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        a, mlp = self.self_attn, self.mlp
        return LayerSpec(
            NormKind.LAYER, self.input_layernorm, None, self.post_attention_layernorm, None,
            None, None, a.qkv_proj, a.o_proj, mlp.c_fc, mlp.c_proj,
            plain_activation(mlp.hidden_act), a.attn, a.rotary, a.attn.scale,
            a.attn.sliding_window, None, gated=False, act=mlp.act)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {k: v for k, v in LlamaForCausalLM.packed_modules_mapping.items()
                              if v[0] == "qkv_proj"}

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return Starcoder2DecoderLayer(cfg, layer_index, rotary)

    def final_norm(self, cfg: ArchConfig) -> nn.Module | None:
        return nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _use_bias(cfg: ArchConfig) -> bool:
    return bool(cfg.extra.get("use_bias", True))
