"""Mixture-of-experts decoders on Llama-style attention: Mixtral (every layer sparse, top-k weights
renormalized), Qwen2-MoE (a sigmoid-gated shared expert beside the routed ones, q/k/v bias) and
Qwen3-MoE (q/k norm). Qwen's mlp_only_layers and decoder_sparse_step keep some layers dense.
Also the reading of checkpoints that stack a layer's experts in one tensor (gpt-oss, Llama 4)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, MoeSpec, NormKind, decoder_spec
from octavo.model.layers.linear import Linear
from octavo.model.layers.moe import FusedMoE
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, make_rotary
from octavo.model.models.base import CausalLM, QKV_GATE_UP
from octavo.model.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from octavo.model.pipeline import stage_layers

# <layer>.experts.<gate_up_proj|down_proj>[_bias | _blocks | _scales]: one tensor per projection
# holding every expert of the layer
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales|_scale)?$")


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, renormalize: bool, shared_expert: bool) -> None:
        super().__init__()
        num_experts = cfg.required("num_experts", "num_local_experts")
        width = cfg.extra.get("moe_intermediate_size") or cfg.intermediate_size
        self.gate = Linear(cfg.hidden_size, [num_experts])
        self.experts = FusedMoE(num_experts, cfg.required("num_experts_per_tok"),
                                cfg.hidden_size, width, cfg.hidden_act, renormalize)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert:
            self.shared_expert = LlamaMLP(cfg, cfg.required("shared_expert_intermediate_size"))
            self.shared_expert_gate = Linear(cfg.hidden_size, [1])

    def moe_spec(self) -> MoeSpec:
        shared = self.shared_expert
        gate_up, down = (None, None) if shared is None else (shared.gate_up_proj,
                                                             shared.down_proj)
        return MoeSpec(self.gate, self.experts.expert_weights(), gate_up, down,
                       self.shared_expert_gate,
                       fused=self.experts, first_expert=self.experts.first_expert,
                       num_experts=self.experts.num_experts)


class MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding, qk_norm: bool,
                 mlp: nn.Module, mlp_name: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qk_norm)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)  # the checkpoint's name: mlp or block_sparse_moe
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, getattr(self, self.mlp_name), NormKind.RMS,
                            self.input_layernorm, self.post_attention_layernorm)


class _MoeForCausalLM(CausalLM):
    packed_modules_mapping = QKV_GATE_UP
    qk_norm = False
    shared_expert = False
    mlp_name = "mlp"

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        rotary = make_rotary(cfg.head_dim, cfg.rotary_dim or cfg.head_dim, max_positions,
                             cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        layers = stage_layers(cfg.num_layers, lambda i: MoeDecoderLayer(
            cfg, i, rotary, self.qk_norm, self._mlp(cfg, i), self.mlp_name))
        self.model = LlamaModel(cfg, layers)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def _mlp(self, cfg: ArchConfig, layer: int) -> nn.Module:
        if not cfg.moe_layer(layer):
            return LlamaMLP(cfg)
        return SparseMoeBlock(cfg, bool(cfg.extra.get("norm_topk_prob", False)),
                              self.shared_expert)


class MixtralForCausalLM(_MoeForCausalLM):
    mlp_name = "block_sparse_moe"

    def _mlp(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(cfg, renormalize=True, shared_expert=False)


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    shared_expert = True


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    qk_norm = True


class StackedExperts:
    """For a causal LM whose checkpoint stacks each layer's experts, [experts, in, out] as
    `x @ W` multiplies (`<layer>.experts.gate_up_proj`, `down_proj`, with `_bias`, or MXFP4's
    `_blocks` and `_scales` [experts, out, ...], or FBGEMM FP8's `_scale`, a scale per output
    column): they are split per expert as they are read, dense weights transposed to octavo's
    [out, in], FP8 scales to [out, 1]. `interleaved_gate_up`: gate and up
    columns alternate (gpt-oss), else gate's come first, then up's (Llama 4)."""

    interleaved_gate_up = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._per_expert(weights))

    def linear_name(self, ckpt_name: str) -> str | None:
        # a stacked expert tensor names its experts' layer as any one expert's tensor does
        m = _STACKED.match(ckpt_name.removesuffix(".weight"))
        if m is not None:
            proj = "gate_proj" if m[2] == "gate_up_proj" else "down_proj"
            ckpt_name = f"{m[1]}.0.{proj}.weight"
        return super().linear_name(ckpt_name)

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _STACKED.match(name)
            if m is None:
                yield name, tensor
                continue
            prefix, proj, suffix = m.groups()
            kind = {"_bias": "bias", "_blocks": "mx_blocks", "_scales": "mx_scales",
                    "_scale": "weight_scale"}.get(suffix, "weight")
            for e in range(tensor.shape[0]):
                # [out, ...]: a dense weight is stored [in, out], MXFP4's blocks and scales
                # [out, ...], FP8 scales [1, out] or [out, 1]
                w = (tensor[e].t() if kind == "weight" else
                     tensor[e].reshape(-1, 1) if kind == "weight_scale" else tensor[e])
                if proj == "down_proj":
                    yield f"{prefix}.{e}.down_proj.{kind}", w
                    continue
                gate, up = ((w[0::2], w[1::2]) if self.interleaved_gate_up
                            else w.chunk(2, dim=0))
                yield f"{prefix}.{e}.gate_proj.{kind}", gate
                yield f"{prefix}.{e}.up_proj.{kind}", up
