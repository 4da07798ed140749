"""DeepSeek V2 and V3 (and R1): multi-head latent attention (MLA) and a mixture of experts with
shared experts.

MLA compresses each token's keys and values into one latent row: kv_lora_rank features (the
compressed KV, RMS-normalized) and qk_rope_head_dim features of a key shared by every head (the
only part RoPE rotates). That row is all the KV cache holds (`kv_cache_spec`: one part, one head,
kv_lora_rank + qk_rope_head_dim features a token). Attention runs on it directly: each head's
query is taken into the latent space by that head's key projection (W_UK of kv_b_proj, absorbed
into the query), so the scores are q_latent . c + q_rope . k_rope, a multi-query attention of
one KV head whose values are the same rows; the output's latent part is brought back out by the
head's value projection (W_UV). The paged kernels read one cache as both K and V. RoPE is on
adjacent pairs (V2 always, V3 with rope_interleave): rows reordered at load. YaRN's mscale
scales the softmax (by mscale(factor, mscale_all_dim) squared).

Experts: V3 scores with a sigmoid, picks within the best expert groups by the scores plus a
learned correction bias, weighs by the plain scores (renormalized where norm_topk_prob) times
routed_scaling_factor; V2 takes a softmax, greedy or within the best groups by their maximum,
times the factor. Shared experts are added ungated. The first first_k_dense_replace layers are
dense. Decode steps run in the fused stack (model/decode_stack.py), which computes the latent
attention from its description (LatentSpec) and the routing from FusedMoE's (Routing). FP8
checkpoints (V3's own) stay FP8 but for kv_b_proj, decoded as it is read."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.kv_spec import KVCacheSpec
from octavo.model.layer_spec import LatentSpec, LayerSpec, MoeSpec, NormKind, decoder_spec
from octavo.model.layers.mla import MlaAttention
from octavo.model.layers.moe import FloatRouter, FusedMoE
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.layers.routing import Routing
from octavo.model.models.llama import LlamaForCausalLM, LlamaMLP
from octavo.model.quant.fp8 import dequantize_fp8


def deepseek_routing(cfg: ArchConfig, router: FloatRouter, top_k: int) -> Routing:
    """V3: sigmoid scores, chosen with the correction bias within the groups best by their top
    two; V2: softmax scores, greedy or within the groups best by their maximum."""
    scale = float(cfg.extra.get("routed_scaling_factor") or 1.0)
    groups, keep = cfg.extra.get("n_group") or 1, cfg.extra.get("topk_group") or 1
    if router.e_score_correction_bias is not None:
        return Routing(top_k, bool(cfg.extra.get("norm_topk_prob")), "sigmoid", scale=scale,
                       groups=groups, keep_groups=keep, group_score="top2",
                       correction=router.e_score_correction_bias)
    method = cfg.extra.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise NotImplementedError(f"{cfg.architecture}: topk_method {method!r} (greedy and "
                                  f"group_limited_greedy are supported)")
    if method == "greedy":
        groups = keep = 1
    return Routing(top_k, scale=scale, groups=groups, keep_groups=keep)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, correction: bool) -> None:
        super().__init__()
        experts, top_k = cfg.required("n_routed_experts"), cfg.required("num_experts_per_tok")
        width = cfg.required("moe_intermediate_size")
        self.gate = FloatRouter(cfg.hidden_size, experts, correction)
        self.experts = FusedMoE(experts, top_k, cfg.hidden_size, width, cfg.hidden_act,
                                renormalize=False,
                                routing=deepseek_routing(cfg, self.gate, top_k))
        shared = cfg.extra.get("n_shared_experts") or 0
        self.shared_experts = LlamaMLP(cfg, width * shared) if shared else None

    def moe_spec(self) -> MoeSpec:
        e, shared = self.experts, self.shared_experts
        return MoeSpec(self.gate, e.expert_weights(),
                       None if shared is None else shared.gate_up_proj,
                       None if shared is None else shared.down_proj, None, fused=e,
                       first_expert=e.first_expert, num_experts=e.num_experts)


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 correction: bool) -> None:
        super().__init__()
        self.self_attn = MlaAttention(cfg, layer_index, rotary)
        dense = layer_index < (cfg.extra.get("first_k_dense_replace") or 0)
        self.mlp = LlamaMLP(cfg) if dense else DeepseekMoE(cfg, correction)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def spec(self) -> LayerSpec:
        # the latent attention is a mixer, which the Python layers compute whole (its forward)
        # and the fused stack from its description
        a = self.self_attn
        compressed = bool(a.q_lora_rank)
        latent = LatentSpec(
            a.q_a_proj if compressed else None, a.q_a_layernorm if compressed else None,
            a.q_b_proj if compressed else a.q_proj, a.kv_a_proj_with_mqa, a.kv_a_layernorm,
            a.kv_b_proj.weight, a.o_proj, a.nope, a.rope, a.v_dim)
        return decoder_spec(a, self.mlp, NormKind.RMS, self.input_layernorm,
                            self.post_attention_layernorm, latent=latent)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    correction = False  # V3's score correction bias
    pairwise_rope = True

    @classmethod
    def kv_cache_spec(cls, cfg: ArchConfig, layer: int) -> KVCacheSpec:
        return KVCacheSpec(1, 1, cfg.required("kv_lora_rank") + cfg.required("qk_rope_head_dim"))

    def make_rotary(self, cfg: ArchConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.required("qk_rope_head_dim"), max_positions, cfg.rope_theta,
                               cfg.rope_scaling, cfg.max_position_embeddings)

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekDecoderLayer(cfg, layer_index, rotary, self.correction)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._dequantized_kv_b(_joined_kv_b(weights)))

    def checkpoint_name(self, name: str) -> str | None:
        # a GGUF's exp_probs_b.bias
        return super().checkpoint_name(name.replace(".e_score_correction.bias",
                                                    ".e_score_correction_bias"))

    def _dequantized_kv_b(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """An FP8 checkpoint's kv_b_proj weights decoded with their scales as they are read:
        the latent attention takes each head's projections apart and absorbs them (as vLLM
        does); every other FP8 layer stays FP8."""
        block = (self.cfg.extra.get("quantization_config") or {}).get("weight_block_size")
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            if not module.endswith(".kv_b_proj") or (
                    kind == "weight" and tensor.dtype != torch.float8_e4m3fn):
                yield name, tensor
                continue
            if kind == "input_scale":  # the activations stay in bf16/float32
                continue
            part = held.setdefault(module, {})
            part[kind] = tensor
            if "weight" in part and ("weight_scale_inv" if block else "weight_scale") in part:
                yield f"{module}.weight", dequantize_fp8(held.pop(module), block)
        if held:
            raise ValueError(f"{sorted(held)[0]}: an FP8 weight without its scales, or scales "
                             f"without their weight")

    def pairwise_rows(self, module: str) -> tuple[int, int, int] | None:
        cfg = self.cfg
        if not self.pairwise_rope:
            return None
        nope, rope = cfg.required("qk_nope_head_dim"), cfg.required("qk_rope_head_dim")
        if module == "kv_a_proj_with_mqa":  # one row group: the latent, then the shared key
            rank = cfg.required("kv_lora_rank")
            return rank + rope, rope, rank
        return (nope + rope, rope, nope) if module in ("q_proj", "q_b_proj") else None


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    correction = True

    @property
    def pairwise_rope(self) -> bool:
        return self.cfg.extra.get("rope_interleave", True) is not False


def _joined_kv_b(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """kv_b_proj whole from a GGUF's k_b_proj [heads, rank, nope] and v_b_proj [heads, v, rank]
    (llama.cpp's converter splits it so, k_b transposed): each head's nope rows, then its v
    rows."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        owner, _, leaf = module.rpartition(".")
        if leaf not in ("k_b_proj", "v_b_proj") or kind != "weight":
            yield name, tensor
            continue
        part = held.setdefault(owner, {})
        part[leaf] = tensor
        if len(part) == 2:
            part = held.pop(owner)
            k_b, v_b = part["k_b_proj"], part["v_b_proj"]
            joined = torch.cat([k_b.transpose(1, 2), v_b], 1)  # [heads, nope + v, rank]
            yield f"{owner}.kv_b_proj.weight", joined.reshape(-1, v_b.shape[2])
    if held:
        raise ValueError(f"{sorted(held)[0]}: k_b_proj without v_b_proj, or the reverse")
