"""Cohere Command R / R+ and Aya: one LayerNorm without a bias feeding attention and the MLP in
parallel (x + attn(ln(x)) + mlp(ln(x))), RoPE on adjacent feature pairs (reordered at load:
LlamaForCausalLM.pairwise_rope), tied embeddings, logits times logit_scale; Command R+ also
LayerNorms q and k per head with a weight per head (use_qk_norm)."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layer_spec import LayerSpec, NormKind, decoder_spec
from octavo.model.layers.norm import HeadLayerNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class CohereDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary)
        if cfg.extra.get("use_qk_norm"):
            a = self.self_attn
            if (a.num_heads, a.num_kv_heads) != (cfg.num_heads, cfg.num_kv_heads):
                raise NotImplementedError(f"{cfg.architecture} with use_qk_norm under tensor "
                                          f"parallelism (its q/k norms have a weight per head)")
            a.q_norm = HeadLayerNorm(cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps)
            a.k_norm = HeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=False)

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.LAYER, self.input_layernorm,
                            self.input_layernorm, parallel_residual=True)


class CohereForCausalLM(LlamaForCausalLM):
    pairwise_rope = True

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.logit_scale = float(cfg.extra.get("logit_scale") or 1.0)

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return CohereDecoderLayer(cfg, layer_index, rotary)

    def final_norm(self, cfg: ArchConfig) -> nn.Module | None:
        return nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=False)
