"""Qwen3-Next: a hybrid of linear and full attention layers (three Gated DeltaNet layers to one
attention layer by default, `layer_types`), each followed by a mixture of experts with a
sigmoid-gated shared expert (Qwen2-MoE's block).

- Linear layers: `GatedDeltaNet` (model/layers/gated_delta_net.py) as the layer's mixer, with a
  recurrent state per request instead of KV-cache blocks (`kv_cache_spec`: nothing).
- Attention layers: the q projection holds each head's query and an output gate
  (`LayerSpec.output_gate`), q/k norms per head, partial RoPE.
- Every RMSNorm scales by (1 + w) in float32 (Gemma's).

Because a state is a running summary of every token before it, a cached prefix resumes from
states saved at its last boundary (core/state_checkpoints.py); a prefix reaching none is
computed again. Under speculative decoding a state waits for the verdict on the drafts before
it moves (worker/spec/verified_spans.py). Tensor parallelism splits the linear layers by key
heads (with their value heads, conv channels and states); under context parallelism with split
tokens every rank computes the linear layers over all of the step's tokens. Every step runs in
the fused decode stack, verification spans included (the linear layers described by
`DeltaNetSpec`)."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import LINEAR, ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import DeltaNetSpec, LayerSpec, NormKind, decoder_spec
from octavo.model.layers.gated_delta_net import CHUNK, GatedDeltaNet
from octavo.model.layers.linear import qkv_parallel
from octavo.model.layers.norm import GemmaRMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from octavo.model.models.moe import SparseMoeBlock


class GatedAttention(LlamaAttention):
    """Attention whose q projection gives each head's query and its output gate."""

    output_gate = True

    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_index, rotary)
        hd = cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads,
                                     bias=cfg.attention_bias, query_parts=2)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)


class Qwen3NextDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if cfg.layer_types[layer_index] == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, layer_index, rotary)
        self.mlp = (SparseMoeBlock(cfg, bool(cfg.extra.get("norm_topk_prob", True)), True)
                    if cfg.moe_layer(layer_index) else LlamaMLP(cfg))
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        linear = getattr(self, "linear_attn", None)
        return decoder_spec(linear or self.self_attn, self.mlp, NormKind.ONE_PLUS,
                            self.input_layernorm, self.post_attention_layernorm,
                            delta_net=None if linear is None else _delta_net_spec(linear))


def _delta_net_spec(a: GatedDeltaNet) -> DeltaNetSpec:
    return DeltaNetSpec(a.in_proj_qkvz, a.in_proj_ba, a.out_proj, a.qkvz_split,
                        a.conv1d.weight.squeeze(1), a.A_log, a.dt_bias, a.norm, a.k_heads,
                        a.v_heads, a.dk, a.dv, CHUNK, a)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    # a GGUF's linear layers: q | k | v and z apart, the four slots of in_proj_qkvz
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping,
                              "in_proj_qkv": ("in_proj_qkvz", (0, 1, 2)),
                              "in_proj_z": ("in_proj_qkvz", 3)}

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return Qwen3NextDecoderLayer(cfg, layer_index, rotary)

    def final_norm(self, cfg: ArchConfig) -> nn.Module | None:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
