"""A step of a Llama-family decoder as one C++ call (octavo/kernels/csrc: DecodeStack).

It takes the steps whose attention the in-place kernel computes whole: decodes, speculative
verification, and prompts (of any length in bf16, else up to paged_attention.KERNEL_CONTEXT_LEN
tokens; a step with a padded SDPA group runs the Python layers). In a decode step every request
brings one token, and for a small model the Python around each kernel costs as much as the
kernel: about a dozen module calls and dispatches a layer, about 3 ms a step for SmolLM2's 30
layers against roughly 5 ms of arithmetic. The stack runs the same kernels in the same order
from C++ (the CPU analogue of replaying a captured CUDA graph), so it needs exactly what those
kernels need, read from each layer's typed weights (`_forms`): dense weights (with or without a
GGUF's int4/int8 copy for small batches) or packed int4 / symmetric int8 weights alone
(--quantization). Anything else
(steps with long prefills, sliding windows, softcaps, an fp8 KV cache, act-order or asymmetric int8
weights, partial rotary, MoE layers, kernels not loaded yet) runs the Python layers.
`--enforce-eager` turns it off. Under tensor parallelism it computes a rank's heads and slices and
calls the ranks' all-reduce after each o and down projection, as the Python layers do.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from octavo.distributed import parallel_state
from octavo.kernels import fused
from octavo.kernels.paged_attention import AttentionPlan
from octavo.model.layers.linear import Linear
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.models.llama import LlamaDecoderLayer, LlamaMLP
from octavo.model.quant.decode_weights import max_rows
from octavo.model.quant.packed import Int4Packed, Int8Grouped, Int8Packed, PackedWeight
from octavo.model.quant.weights import DenseWeights, PackedWeights

logger = logging.getLogger(__name__)


def unsupported_reason(layers: nn.ModuleList) -> str | None:
    """Why these decoder layers cannot run as one stack (None: they can)."""
    eps: set[float] = set()
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return f"layer type {type(layer).__name__}/{type(getattr(layer, 'mlp', None)).__name__}"
        attn = layer.self_attn
        if layer.mlp.act is not fused.silu_and_mul:
            return "a gated activation other than silu"
        if type(attn.rotary) is not RotaryEmbedding:
            return f"rotary embedding {type(attn.rotary).__name__}"
        if attn.attn.sliding_window or attn.attn.softcap:
            return "a sliding window or attention softcap"
        if attn.o_proj.bias is not None:
            return "an o_proj bias"
        for lin in _linears(layer):
            reason = _weight_reason(lin, layer.input_layernorm.weight.dtype)
            if reason is not None:
                return reason
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if any(type(n) is not RMSNorm for n in norms):
            return "a norm other than RMSNorm"
        eps.update(n.eps for n in norms)
    if len(eps) > 1:
        return "RMSNorm epsilons that differ between norms"
    return None


def _linears(layer: nn.Module) -> list[Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _forms(lin: Linear) -> tuple[torch.Tensor | None, PackedWeight | None] | None:
    """The two forms the stack computes a linear layer with: its dense weight (None: packed
    only) and a low-bit weight (its copy for small batches, or the packed weight alone); None
    for weights of another type."""
    weights = lin.weights
    if isinstance(weights, DenseWeights):
        return weights.weight, weights.small_batch
    if isinstance(weights, PackedWeights):
        return None, weights.packed
    return None


def _weight_reason(lin: Linear, dtype: torch.dtype) -> str | None:
    """What the stack cannot compute of a linear layer: a dense weight (the activation dtype)
    with at most a low-bit copy for small batches beside it, or a packed weight alone (what
    --quantization int4/int8 and packed checkpoints leave): int4, or symmetric int8 with a
    scale per channel or per group."""
    forms = _forms(lin)
    if forms is None:
        return f"{type(lin.weights).__name__} linear weights"
    _, low = forms
    if low is None:
        return None
    if low.perm is not None:
        return "a permuted (act-order) packed weight"
    if isinstance(low, Int4Packed):
        return None if low.dtype == dtype else "int4 scales in another dtype"
    if isinstance(low, Int8Packed) and (low.q.shape[0] != 1 or low.zero_term is not None):
        return "a grouped or asymmetric int8 weight"
    if isinstance(low, (Int8Packed, Int8Grouped)):
        return None
    return f"a {type(low).__name__} weight"


def _row_limit(lin: Linear) -> int | None:
    """The most rows the stack computes of `lin` as its Python layer does (None: any)."""
    dense, low = _forms(lin)
    if dense is not None:
        return None
    # Packed alone: the Python layer takes dequantized tiles above an int4 or grouped int8
    # weight's dense_rows, and torch's int8 kernel for per-channel int8 above 8 rows.
    return 8 if isinstance(low, Int8Packed) else low.dense_rows


def _linear(native: Any, lin: Linear) -> Any:
    dense, low = _forms(lin)
    if isinstance(low, Int4Packed) and fused.int4_gemm_ready(low.dtype):  # octavo's int4 kernel
        kind, a, b = 5, *low.native_layout()
    elif isinstance(low, Int4Packed):  # torch's kernel, groups of 32
        kind, a, b = 4, *low.torch_layout()
    elif isinstance(low, Int8Packed):
        kind, a, b = 8, low.q[0], low.scale[0]
    elif isinstance(low, Int8Grouped):  # scales [N, G]: the GEMV applies them per group
        kind, a, b = 8, low.q, low.scale
    else:
        kind, a, b = 0, None, None
    out = dense.shape[0] if dense is not None else low.out_features
    rows = max_rows(low) if low is not None else 0
    return native.StackLinear(dense, lin.bias, kind, a, b, out, rows)


class DecodeStack:
    """Builds the C++ stack the first time a step can use it, for the KV caches of that step."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.dtype = layers[0].input_layernorm.weight.dtype  # the activations it computes in
        self._stack: Any = None
        self._caches: list[torch.Tensor] | None = None
        # Tokens a step may have (packed-only layers compute small batches only); None: any.
        limits = [n for layer in layers for lin in _linears(layer)
                  if (n := _row_limit(lin)) is not None]
        self.max_tokens: int | None = min(limits) if limits else None

    def usable(self, x: torch.Tensor, plan: AttentionPlan, sliding: AttentionPlan | None,
               kv_caches: list[torch.Tensor]) -> bool:
        return (not plan.groups and plan.decode is not None and sliding is None
                and fused.native_active(x) and x.dtype == self.dtype == kv_caches[0].dtype
                and (self.max_tokens is None or x.shape[0] <= self.max_tokens))

    def rebuild(self) -> None:
        """Build the C++ stack anew at the next step: its layers hold the weights they were
        built with, and the model's weights were replaced (model/loader/gemm_packing.py)."""
        self._stack, self._caches = None, None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if self._caches is not kv_caches:
            self._build(kv_caches)
        d = plan.decode
        return self._stack.forward(x, positions, d.token_index, d.block_table, d.seq_lens,
                                   plan.slot_mapping)

    def _build(self, kv_caches: list[torch.Tensor]) -> None:
        native = fused.native_module()
        first = self.layers[0].self_attn
        rotary = first.rotary
        stack = native.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim,
                                   self.layers[0].input_layernorm.eps, first.attn.scale,
                                   rotary.cos, rotary.sin)
        if parallel_state.tp_size() > 1:  # the row-parallel projections' partial sums
            stack.set_all_reduce(parallel_state.tp_all_reduce)
        for layer in self.layers:
            attn = layer.self_attn
            stack.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.q_norm.weight if attn.q_norm is not None else None,
                attn.k_norm.weight if attn.k_norm is not None else None,
                [_linear(native, lin) for lin in _linears(layer)],
                kv_caches[attn.attn.layer_index])
        self._stack, self._caches = stack, kv_caches


def attach(model: nn.Module) -> DecodeStack | None:
    """Give `model` (a causal LM over a LlamaModel) a decode stack if its layers allow one."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "decode_stack"):
        logger.info("decode steps run layer by layer: %s has no decoder stack octavo fuses",
                    type(model).__name__)
        return None
    reason = unsupported_reason(layers)
    if reason is not None:
        logger.info("decode steps run layer by layer: the model has %s", reason)
        return None
    inner.decode_stack = DecodeStack(layers)
    return inner.decode_stack
