"""IBM Granite (3.x): Llama's layers with four scales from config.json: the embeddings times
embedding_multiplier, each sublayer's output times residual_multiplier before the residual add,
attention scores times attention_multiplier (in place of 1 / sqrt(head_dim)), and the logits
divided by logits_scaling."""
from __future__ import annotations

from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.logit_scale = 1.0 / _scale(cfg, "logits_scaling")

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer_index, rotary, qk_norm=False,
                                 residual_scale=_scale(cfg, "residual_multiplier"),
                                 attention_scale=cfg.extra.get("attention_multiplier"))

    def embedding_scale(self, cfg: ArchConfig) -> float:
        return _scale(cfg, "embedding_multiplier")


def _scale(cfg: ArchConfig, key: str) -> float:
    value = cfg.extra.get(key)
    value = 1.0 if value is None else float(value)
    if not value > 0:
        raise ValueError(f"config.json: {key} must be a positive number, got {value}")
    return value
