"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, InternLM 3): RMSNorm,
GQA with RoPE, SwiGLU. Qwen3 also RMS-normalizes q and k per head before RoPE; Phi-3 checkpoints
store q/k/v and gate/up already packed (the names match), with longrope and possibly partial
rotary. The families that differ from Llama only in their layer, final norm or scales (Granite,
OLMo 2, StarCoder 2, Cohere, GLM) build on these classes in their own files."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.decode_stack import run_layers
from octavo.model.layer_spec import LayerSpec, NormKind, decoder_spec
from octavo.model.layers.activation import gated_act
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.embedding import Embedding
from octavo.model.layers.linear import (
    Linear,
    column_parallel,
    heads_output,
    local_heads,
    qkv_parallel,
    row_parallel,
)
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, make_rotary, pairs_to_halves
from octavo.model.models.base import QKV_GATE_UP, CausalLM
from octavo.model.pipeline import is_last_stage, stage_layers
from octavo.model.quant.gguf import CODE8_KINDS, CODE_KINDS


# Tensors with one row per output feature, which a reordering of q/k rows reorders alike.
_OUTPUT_ROW_KINDS = ("weight", "bias", *CODE_KINDS, *CODE8_KINDS)


def output_bias(cfg: ArchConfig) -> bool:
    """Whether o_proj has a bias: Llama's attention_bias covers it (Qwen2's implied q/k/v bias
    does not), and InternLM 3's `bias`."""
    return bool(cfg.extra.get("attention_bias") or cfg.extra.get("bias"))


class LlamaAttention(nn.Module):
    """Grouped-query attention over q/k/v and o projections, with optional q/k RMSNorms per
    head (Qwen3) or over all of a token's heads (`qk_norm_whole`, OLMo 2), and the families'
    own biases and scale."""

    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool = False, *, qk_norm_whole: bool = False,
                 qkv_bias: bool | None = None, o_bias: bool | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = hd = cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads,
                                     bias=cfg.attention_bias if qkv_bias is None else qkv_bias)
        self.o_proj = heads_output(hd, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size,
                                   bias=output_bias(cfg) if o_bias is None else o_bias)
        if qk_norm_whole and (self.num_heads, self.num_kv_heads) != (cfg.num_heads,
                                                                     cfg.num_kv_heads):
            raise NotImplementedError(f"{cfg.architecture} under tensor parallelism: its q/k "
                                      f"norms span all heads, which the ranks split")
        q_width, k_width = ((cfg.num_heads * hd, cfg.num_kv_heads * hd) if qk_norm_whole
                            else (hd, hd))
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if qk_norm else None
        self.qk_norm_whole = qk_norm_whole
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, hd,
                                   scale=hd ** -0.5 if scale is None else scale,
                                   sliding_window=cfg.layer_window(layer_index),
                                   chunk=cfg.layer_chunk(layer_index))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        bias = bool(cfg.extra.get("mlp_bias"))
        self.gate_up_proj = column_parallel(cfg.hidden_size, [width] * 2, bias=bias,
                                            what="intermediate_size")
        self.down_proj = row_parallel(width, cfg.hidden_size, bias=bias, what="intermediate_size")
        self.act = gated_act(cfg.hidden_act)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer_index: int, rotary: RotaryEmbedding,
                 qk_norm: bool, residual_scale: float = 1.0,
                 attention_scale: float | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, qk_norm, scale=attention_scale)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_scale = residual_scale

    def spec(self) -> LayerSpec:
        return decoder_spec(self.self_attn, self.mlp, NormKind.RMS, self.input_layernorm,
                            self.post_attention_layernorm, residual_scale=self.residual_scale)


class LlamaModel(nn.Module):
    """Embedding (times `embedding_scale`: Granite), the decoder layers (built by the family),
    the final norm (RMSNorm unless the family gives its own)."""

    def __init__(self, cfg: ArchConfig, layers: nn.ModuleList, norm: nn.Module | None = None,
                 embedding_scale: float = 1.0) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if norm is None else norm
        self.embedding_scale = embedding_scale
        self.decode_stack = None  # octavo/model/decode_stack.py attaches one where it fits
        self.compiled_layers = None  # octavo/model/compiled.py, at compilation levels 1-3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            x = self.embed_tokens(input_ids)
            if self.embedding_scale != 1.0:
                x = x * self.embedding_scale
        else:
            x = hidden
        x = run_layers(self.layers, self.decode_stack, x, positions, self.compiled_layers)
        return self.norm(x) if is_last_stage() else x


class LlamaForCausalLM(CausalLM):
    """Llama and the families that differ from it only in their decoder layer
    (`decoder_layer`), final norm (`final_norm`) or scales."""

    packed_modules_mapping = QKV_GATE_UP
    qk_norm = False
    # The checkpoint rotates adjacent feature pairs (GPT-J's RoPE: Cohere, GLM): its q/k rows
    # are reordered at load for the rotate-half kernels (rotary.pairs_to_halves).
    pairwise_rope = False

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        rotary = self.make_rotary(cfg, max_positions)
        self.model = LlamaModel(
            cfg, stage_layers(cfg.num_layers, lambda i: self.decoder_layer(cfg, i, rotary)),
            self.final_norm(cfg), self.embedding_scale(cfg))
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def rotary_dim(self, cfg: ArchConfig) -> int:
        return cfg.rotary_dim or cfg.head_dim

    def make_rotary(self, cfg: ArchConfig, max_positions: int) -> RotaryEmbedding:
        return make_rotary(cfg.head_dim, self.rotary_dim(cfg), max_positions, cfg.rope_theta,
                           cfg.rope_scaling, cfg.max_position_embeddings)

    def decoder_layer(self, cfg: ArchConfig, layer_index: int,
                      rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer_index, rotary, self.qk_norm)

    def final_norm(self, cfg: ArchConfig) -> nn.Module | None:
        return None  # RMSNorm

    def embedding_scale(self, cfg: ArchConfig) -> float:
        return 1.0

    def pairwise_rows(self, module: str) -> tuple[int, int, int] | None:
        """Where `module`'s output rows hold adjacent RoPE pairs to reorder at load: (a head's
        rows, its rotary features, their offset in it); None: nothing to reorder."""
        if not self.pairwise_rope or module not in ("q_proj", "k_proj", "q_norm", "k_norm"):
            return None
        return self.cfg.head_dim, self.rotary_dim(self.cfg), 0

    def convert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        module, kind = name.split(".")[-2:]
        rows = self.pairwise_rows(module)
        if rows is None:
            return tensor
        if kind == "weight_scale" and tensor.numel() == 1:  # FP8, one scale per tensor
            return tensor
        if kind == "weight_scale_inv" and self._reorder_within_blocks(tensor, rows):
            return tensor  # FP8 block scales: each reordered row stays in its block of rows
        if kind not in _OUTPUT_ROW_KINDS and kind != "weight_scale":
            raise NotImplementedError(
                f"{name}: {self.cfg.architecture} rotates adjacent feature pairs, for which "
                f"octavo reorders q/k rows at load; it does that for tensors with a row per "
                f"output feature (dense weights, biases, a GGUF's codes), not packed {kind!r} "
                f"tensors (load the unquantized checkpoint, or --quantization)")
        # rows of heads along dim 0 (a per-head norm's weight [heads, head_dim], a per-channel
        # scale [rows, 1]: flattened)
        flat = tensor.reshape(-1) if module.endswith("norm") or kind == "weight_scale" \
            else tensor
        return pairs_to_halves(flat, *rows).reshape(tensor.shape)

    def _reorder_within_blocks(self, scales: torch.Tensor, rows: tuple[int, int, int]) -> bool:
        """Whether the rows reordered (each head's rotary features) lie inside one block of an
        FP8 checkpoint's block scales [N / b0, K / b1] in every head."""
        block = (self.cfg.extra.get("quantization_config") or {}).get("weight_block_size")
        if not block:
            return False
        head, rotary, offset = rows
        first = torch.arange(scales.shape[0] * block[0] // head) * head + offset
        return bool(torch.equal(first // block[0], (first + rotary - 1) // block[0]))


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder with a classifier over its last token instead of an LM head (`score`, no
    bias: Llama's, Mistral's and Qwen's *ForSequenceClassification): it classifies and scores,
    it does not generate."""

    classifier_token = "last"  # what the head reads (model/pooler.py)

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        del self.lm_head
        self.score = Linear(cfg.hidden_size, [cfg.num_labels])

    def classify(self, last_states: torch.Tensor) -> torch.Tensor:
        return self.score(last_states.to(self.dtype)).float()


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
