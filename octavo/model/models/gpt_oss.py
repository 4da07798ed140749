"""OpenAI gpt-oss: Llama-style attention with q/k/v/o biases, a learned sink logit per head in
every softmax (PagedAttention's `sinks`), sliding-window and full layers alternating, YaRN RoPE,
and a mixture of experts in every layer: a router with a bias, softmax over the top-k logits,
experts with biases and a clamped SwiGLU whose gate and up columns the checkpoint interleaves.

The checkpoint stacks each layer's experts (models/moe.py StackedExperts), dense or in MXFP4
(quantization_config `mxfp4`: kept packed, quant/microscaled.py), gate and up columns
interleaved."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, MoeSpec, NormKind, decoder_spec
from octavo.model.layers.activation import ClampedSwiGLU
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.linear import Linear, Span, head_share
from octavo.model.layers.moe import FusedMoE
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM
from octavo.model.models.moe import StackedExperts


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        num_experts = cfg.num_experts
        self.router = Linear(cfg.hidden_size, [num_experts], bias=True)
        act = ClampedSwiGLU(float(cfg.extra.get("swiglu_alpha", 1.702)),
                            float(cfg.extra.get("swiglu_limit", 7.0)))
        self.experts = FusedMoE(num_experts, int(cfg.extra["num_experts_per_tok"]),
                                cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                renormalize=True, bias=True, act=act)

    def moe_spec(self) -> MoeSpec:
        e = self.experts
        # softmax over the top-k logits: the top-k of the softmax, renormalized
        return MoeSpec(self.router, e.expert_weights(), None, None, None,
                       fused=e, first_expert=e.first_expert, num_experts=e.num_experts)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qkv_bias=True, o_bias=True)
        a = self.self_attn
        share = head_share(cfg.num_heads, cfg.num_kv_heads)
        a.attn = PagedAttention(layer_index, a.num_heads, a.num_kv_heads, a.head_dim,
                                scale=a.head_dim ** -0.5,
                                sliding_window=cfg.layer_window(layer_index),
                                sinks=Span(share.q_first, share.q_heads, cfg.num_heads))
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.RMS, self.input_layernorm,
                            self.post_attention_layernorm)


class GptOssForCausalLM(StackedExperts, LlamaForCausalLM):
    interleaved_gate_up = True

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return GptOssDecoderLayer(cfg, layer_index, rotary)

    def checkpoint_name(self, name: str) -> str | None:
        if name.endswith(".sinks.weight"):  # a GGUF's attn_sinks
            name = name.removesuffix(".weight")
        return super().checkpoint_name(name.replace(".self_attn.sinks", ".self_attn.attn.sinks"))
