"""GPT-2: learned absolute positions, LayerNorm with bias, a plain GELU MLP, and Conv1D weights
(stored [in, out], transposed on load)."""
from __future__ import annotations

import re

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.decode_stack import run_layers
from octavo.model.layer_spec import LayerSpec, NormKind, plain_activation
from octavo.model.layers.activation import activation
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.embedding import Embedding, LMHead
from octavo.model.layers.linear import (
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.models.base import CausalLM
from octavo.model.pipeline import is_last_stage, stage_layers

_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
_MASK_BUFFER = re.compile(r"\.attn\.(bias|masked_bias)$")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, _ = local_heads(cfg.num_heads, cfg.num_heads)
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.c_attn = qkv_parallel(h, self.head_dim, cfg.num_heads, cfg.num_heads, bias=True)
        self.c_proj = heads_output(self.head_dim, cfg.num_heads, cfg.num_heads, h, bias=True)
        scale = self.head_dim ** -0.5 if cfg.extra.get("scale_attn_weights", True) else 1.0
        if cfg.extra.get("scale_attn_by_inverse_layer_idx"):
            scale /= layer_index + 1
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_heads, self.head_dim,
                                   scale)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.c_fc = column_parallel(cfg.hidden_size, [cfg.intermediate_size], bias=True,
                                    what="intermediate_size")
        self.c_proj = row_parallel(cfg.intermediate_size, cfg.hidden_size, bias=True,
                                   what="intermediate_size")
        self.hidden_act = cfg.hidden_act
        self.act = activation(cfg.hidden_act)


class GPT2Block(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = GPT2Attention(cfg, layer_index)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def spec(self) -> LayerSpec:
        a, mlp = self.attn, self.mlp
        return LayerSpec(
            NormKind.LAYER, self.ln_1, None, self.ln_2, None, None, None, a.c_attn, a.c_proj,
            mlp.c_fc, mlp.c_proj, plain_activation(mlp.hidden_act), a.attn, None, a.attn.scale,
            None, None, gated=False, act=mlp.act)  # positions: added with the embeddings


class GPT2Model(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_positions}) exceeds the "
                             f"{cfg.max_position_embeddings} positions GPT-2 learned")
        self.wte = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = stage_layers(cfg.num_layers, lambda i: GPT2Block(cfg, i))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.decode_stack = None  # octavo/model/decode_stack.py attaches one where it fits
        self.compiled_layers = None  # octavo/model/compiled.py, at compilation levels 1-3

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (the checkpoint calls them h), by the name the stack looks for."""
        return self.h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions) if hidden is None else hidden
        x = run_layers(self.h, self.decode_stack, x, positions, self.compiled_layers)
        return self.ln_f(x) if is_last_stage() else x


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.model = GPT2Model(cfg, max_positions)
        # GPT-2 always ties its head to the token embeddings.
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, self.model.wte)

    def checkpoint_name(self, name: str) -> str | None:
        if _MASK_BUFFER.search(name) or name == "lm_head.weight":
            return None
        name = name.removeprefix("transformer.")
        return super().checkpoint_name(f"model.{name}")

    def convert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if _CONV1D.search(name) else tensor
