"""BERT encoders (`BertModel`: sentence-transformers' all-MiniLM and its kin): learned absolute
positions and token types added to the token embeddings, then post-norm layers (LayerNorm after
each residual sum) of bidirectional attention and a GELU MLP, every projection with a bias. The
output is every token's hidden state, which the pooler turns into an embedding
(model/pooler.py); there is no LM head. `BertForSequenceClassification` (cross-encoders,
rerankers) adds BERT's pooler (a dense layer and tanh over [CLS]) and a classifier over it.

A sentence pair is one sequence, [CLS] A [SEP] B [SEP]: its tokens after the first separator
are of token type 1, as the tokenizer's pair encoding makes them."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.context import get_forward_context
from octavo.model.layers.activation import activation
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
from octavo.model.models.base import EncoderModel


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = Embedding(cfg.vocab_size, h)
        # the checkpoint's table (RoBERTa's holds its padding offset beyond the context)
        self.position_embeddings = Embedding(cfg.extra.get("max_position_embeddings",
                                                           cfg.max_position_embeddings), h)
        self.token_type_embeddings = Embedding(cfg.extra.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, _ = local_heads(cfg.num_heads, cfg.num_heads)
        self.head_dim = cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads,
                                     bias=True)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.num_heads * self.head_dim, dim=-1)
        return batch.attend(q, k, v, self.num_heads, self.head_dim, self.scale)


class BertResidualOutput(nn.Module):
    """A projection back to the hidden size, added to the residual, then LayerNorm."""

    def __init__(self, dense: nn.Module, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense = dense
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)  # the checkpoint's name
        self.output = BertResidualOutput(
            heads_output(cfg.head_dim, cfg.num_heads, cfg.num_heads, cfg.hidden_size, bias=True),
            cfg)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense = column_parallel(cfg.hidden_size, [cfg.intermediate_size], bias=True,
                                     what="intermediate_size")
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertResidualOutput(
            row_parallel(cfg.intermediate_size, cfg.hidden_size, bias=True,
                         what="intermediate_size"), cfg)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(EncoderModel):
    position_offset = 0  # a token's position in the table: its place in the sequence + this
    # checkpoint name fragment -> (packed parameter fragment, slot)
    packed_modules_mapping = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1),
                              "value": ("qkv_proj", 2)}

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] (the step's sequences, each whole) -> hidden [T, hidden]"""
        layout = get_forward_context().layout
        batch = EncoderBatch(layout.starts, layout.ends, input_ids.device)
        x = self.embeddings(input_ids, positions + self.position_offset,
                            self._token_types(input_ids, layout))
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def _token_types(self, input_ids: torch.Tensor, layout) -> torch.Tensor:
        """0 up to each sequence's first separator, 1 after it (a pair's second text)."""
        sep = self.cfg.sep_token_id
        if sep is None or self.cfg.extra.get("type_vocab_size", 2) < 2:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == sep).long()
        seen = is_sep.cumsum(0) - is_sep  # separators before each token, over the flat step
        before = seen[torch.from_numpy(layout.starts).to(input_ids.device)]  # ... its sequence
        own = seen - before.repeat_interleave(
            torch.from_numpy(layout.ends - layout.starts).to(input_ids.device))
        return (own > 0).long()

    def checkpoint_name(self, name: str) -> str | None:
        # BertModel's own pooler (a dense + tanh over [CLS]) is not what sentence embeddings
        # use; its position ids are a buffer of 0..max-1
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            return None
        return name


class BertForSequenceClassification(BertModel):
    """A cross-encoder: BERT, its pooler over [CLS] and a classifier of `num_labels` outputs
    (`classify`: pooled [CLS] states -> logits)."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.pooler = BertPooler(cfg)
        self.classifier = Linear(cfg.hidden_size, [cfg.num_labels], bias=True)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(cls_states.to(self.dtype))).float()

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("bert.")
        return None if name.endswith("position_ids") else name


class BertPooler(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.hidden_size], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class RobertaModel(BertModel):
    """RoBERTa and XLM-R: BERT's layers; positions counted from the padding id + 1 (a padded
    batch's pads keep the padding id's position), one token type."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.position_offset = cfg.extra.get("pad_token_id", 1) + 1

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.removeprefix("roberta."))


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa / XLM-R cross-encoder: a dense layer, tanh and a projection over <s>, with no
    BERT pooler (`classify`)."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.classifier = RobertaClassificationHead(cfg)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(cls_states.to(self.dtype)).float()


class RobertaClassificationHead(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.hidden_size], bias=True)
        self.out_proj = Linear(cfg.hidden_size, [cfg.num_labels], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))
