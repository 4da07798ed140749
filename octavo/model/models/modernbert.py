"""ModernBERT encoders (`ModernBertModel`: embedding models such as gte-modernbert and
modernbert-embed; `ModernBertForSequenceClassification`: rerankers and classifiers). Unlike BERT:
no position table but rotary positions, pre-norm layers (LayerNorms without biases by default;
none before the first layer's attention), fused q/k/v (`Wqkv`), a GeGLU MLP (`Wi` holds the
activated half, then the gate), no token types, and local layers: every
`global_attn_every_n_layers`-th layer attends over the whole sequence (its own RoPE base), the
others only within `local_attention / 2` tokens on either side. The output is every token's
hidden state after a final norm, which the pooler turns into an embedding."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.context import get_forward_context
from octavo.model.layers.activation import activation, gated_act
from octavo.model.layers.embedding import Embedding
from octavo.model.layers.encoder_attention import EncoderBatch
from octavo.model.layers.linear import (
    Linear,
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.base import EncoderModel


def _norm(cfg: ArchConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=cfg.extra.get("norm_bias", False))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        bias = cfg.extra.get("attention_bias", False)
        self.num_heads, _ = local_heads(cfg.num_heads, cfg.num_heads)
        self.head_dim = cfg.head_dim
        self.Wqkv = qkv_parallel(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads,
                                 bias=bias)
        self.Wo = heads_output(cfg.head_dim, cfg.num_heads, cfg.num_heads, cfg.hidden_size,
                               bias=bias)
        self.rotary = rotary
        self.window = cfg.layer_window(layer_index)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                batch: EncoderBatch) -> torch.Tensor:
        width = self.num_heads * self.head_dim
        q, k, v = self.Wqkv(x).split(width, dim=-1)
        heads = (-1, self.num_heads, self.head_dim)
        q, k = self.rotary(positions, q.reshape(heads), k.reshape(heads))
        out = batch.attend(q.reshape(-1, width), k.reshape(-1, width), v, self.num_heads,
                           self.head_dim, self.scale, self.window)
        return self.Wo(out)


class ModernBertMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        bias = cfg.extra.get("mlp_bias", False)
        width = cfg.intermediate_size
        self.Wi = column_parallel(cfg.hidden_size, [width] * 2, bias=bias, what="intermediate_size")
        self.Wo = row_parallel(width, cfg.hidden_size, bias=bias, what="intermediate_size")
        self.act = gated_act(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(x)))


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer_index == 0 else _norm(cfg)
        self.attn = ModernBertAttention(cfg, layer_index, rotary)
        self.mlp_norm = _norm(cfg)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                batch: EncoderBatch) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, batch)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(EncoderModel):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        full = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)
        local = full if cfg.rope_local_theta is None else \
            RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta)
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(
            ModernBertLayer(cfg, i, full if cfg.layer_window(i) is None else local)
            for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] (the step's sequences, each whole) -> hidden [T, hidden]"""
        layout = get_forward_context().layout
        batch = EncoderBatch(layout.starts, layout.ends, input_ids.device)
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return self.final_norm(x)

    def checkpoint_name(self, name: str) -> str | None:
        return name.removeprefix("model.")


class ModernBertForSequenceClassification(ModernBertModel):
    """ModernBERT, its prediction head (dense, activation, norm) over the [CLS] state or the
    tokens' mean (`classifier_pooling`), and a classifier of `num_labels` outputs."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.classifier_token = cfg.extra.get("classifier_pooling", "cls")
        self.head = ModernBertPredictionHead(cfg)
        self.classifier = Linear(cfg.hidden_size, [cfg.num_labels], bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled.to(self.dtype))).float()


class ModernBertPredictionHead(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.hidden_size],
                            bias=cfg.extra.get("classifier_bias", False))
        self.act = activation(cfg.extra.get("classifier_activation", "gelu"))
        self.norm = _norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))
