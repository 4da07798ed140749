"""Llama 4 (Scout, Maverick), text only: Llama's attention and MLPs with what Llama 4 adds.

- Three of every four layers use RoPE (on adjacent pairs: rows reordered at load) with q/k
  RMS-normalized per head without a weight, and attend within chunks of attention_chunk_size
  tokens (PagedAttention's `chunk`: the step's chunked plan). The fourth has no RoPE
  (no_rope_layers 0), attends to the whole context, and scales its queries by a factor that
  grows with the position (attn_temperature_tuning).
- MoE layers (moe_layers, or every interleave_moe_layer_step-th) route each token to its top-k
  experts by the sigmoid of their router logits; the weight scales the expert's input, not its
  output. A shared expert is added ungated. The other layers are dense MLPs of
  intermediate_size_mlp.
- The checkpoint stacks each layer's experts (models/moe.py StackedExperts). A
  Llama4ForConditionalGeneration checkpoint's text model is read, its vision tower skipped.

Decode steps run in the fused stack (model/decode_stack.py): chunked layers read the step's
chunked plan there too, and the routing is FusedMoE's description (layers/routing.py)."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, MoeSpec, NormKind, decoder_spec
from octavo.model.layers.linear import Linear
from octavo.model.layers.moe import FusedMoE
from octavo.model.layers.norm import RMSNorm, UnitRMSNorm
from octavo.model.layers.rotary import QueryTemperature, RotaryEmbedding
from octavo.model.layers.routing import Routing
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from octavo.model.models.moe import StackedExperts


class Llama4MoE(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        experts, top_k = cfg.required("num_local_experts"), cfg.required("num_experts_per_tok")
        self.router = Linear(cfg.hidden_size, [experts])
        self.experts = FusedMoE(experts, top_k, cfg.hidden_size, cfg.intermediate_size,
                                cfg.hidden_act, renormalize=False, weigh_inputs=True,
                                routing=Routing(top_k, scoring="sigmoid", choose_by="logits"))
        self.shared_expert = LlamaMLP(cfg)

    def moe_spec(self) -> MoeSpec:
        e, shared = self.experts, self.shared_expert
        return MoeSpec(self.router, e.expert_weights(), shared.gate_up_proj,
                       shared.down_proj, None, fused=e, first_expert=e.first_expert,
                       num_experts=e.num_experts)


def _uses_rope(cfg: ArchConfig, layer: int) -> bool:
    # no_rope_layers[i] is 1 where layer i uses RoPE (transformers' default: all but every
    # fourth, no_rope_layer_interval)
    flags = cfg.extra.get("no_rope_layers")
    if flags:
        return bool(flags[layer])
    return (layer + 1) % (cfg.extra.get("no_rope_layer_interval") or 4) != 0


def _moe_layer(cfg: ArchConfig, layer: int) -> bool:
    layers = cfg.extra.get("moe_layers")
    if layers is not None:
        return layer in layers
    step = cfg.extra.get("interleave_moe_layer_step") or 1
    return (layer + 1) % step == 0


class Llama4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        rope = _uses_rope(cfg, layer_index)
        position: nn.Module | None = rotary
        if not rope:
            position = (QueryTemperature(cfg.extra.get("floor_scale", 8192),
                                             cfg.extra.get("attn_scale", 0.1))
                        if cfg.extra.get("attn_temperature_tuning", True) else None)
        self.self_attn = a = LlamaAttention(cfg, layer_index, position)
        if rope and cfg.extra.get("use_qk_norm", True):
            a.q_norm = UnitRMSNorm(a.head_dim, cfg.rms_norm_eps)
            a.k_norm = UnitRMSNorm(a.head_dim, cfg.rms_norm_eps)
        self.feed_forward = (Llama4MoE(cfg) if _moe_layer(cfg, layer_index) else
                             LlamaMLP(cfg, cfg.required("intermediate_size_mlp")))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.feed_forward, NormKind.RMS,
                            self.input_layernorm, self.post_attention_layernorm)


class Llama4ForCausalLM(StackedExperts, LlamaForCausalLM):
    pairwise_rope = True

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return Llama4DecoderLayer(cfg, layer_index, rotary)

    def checkpoint_name(self, name: str) -> str | None:
        # Llama4ForConditionalGeneration keeps the text model under language_model.
        if "vision_model." in name or "multi_modal_projector." in name:
            return None
        name = name.replace("model.language_model.", "model.")
        return super().checkpoint_name(name.removeprefix("language_model."))
