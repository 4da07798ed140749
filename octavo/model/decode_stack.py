"""A step of a decoder of any family octavo has (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2 and 3,
GPT-NeoX, GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE, InternLM 3, Granite, OLMo 2, StarCoder 2,
Cohere, GLM, gpt-oss, DeepSeek V2 and V3, Llama 4, Qwen3-Next) as one C++ call
(csrc/decode_stack.h).

It takes the steps whose attention the in-place kernel computes whole: decodes, speculative
verification, and prompts (of any length in bf16, else up to paged_attention.KERNEL_CONTEXT_LEN
tokens; a step with a padded SDPA group, in its plan or its sliding-window plan, runs the Python
layers). In a decode step every request brings one token, and for a small model the Python
around each kernel costs as much as the kernel: about a dozen module calls and dispatches a
layer, about 3 ms a step for SmolLM2's 30 layers against roughly 5 ms of arithmetic. The stack
runs the same kernels in the same order from C++ (the CPU analogue of replaying a captured CUDA
graph), so it needs exactly what those kernels need. What a layer is comes from its description
(`layer.spec()`, model/layer_spec.py): RMSNorm, Gemma's 1 + w or LayerNorm (with or without a
bias), norms before each sublayer, after it or both, sequential or parallel residuals (scaled
or not), q/k norms per head or over all heads (RMS, or Cohere's LayerNorms per head), the
attention's scale,
sliding window, chunk and softcap, its RoPE tables (over the whole head or its first rotary_dim
features, or none; Llama 4's query temperature in their place), or DeepSeek's latent attention
(its LatentSpec) or Qwen3-Next's linear attention (its DeltaNetSpec: each request's state moved
over its tokens, or left for the verdict where they end in draft tokens), attention with an
output gate, and a gated or plain MLP
or a mixture of experts (router, its Routing: softmax or sigmoid scores, expert groups, a
correction bias, renormalization and scale, weighing the experts' outputs or inputs; a shared
expert, gated or not; tokens grouped by expert, as FusedMoE groups them). The
weights are read from each linear layer's typed weights (`_forms`): dense weights (with or
without a GGUF's int4/int8 copy for small batches) or packed int4 / symmetric int8 /
microscaled (MX, NVFP4, FP8) weights alone (GGUFs, quantized checkpoints, --quantization: their
kernels up to the rows they win at, dequantized tiles into the dense GEMM or int8-quantized
activations above, as the Python layers compute them); the KV
cache is in the activations' dtype or in fp8 (with each layer's k/v scales); attention sinks
scale each head's output by sigmoid(log-sum-exp - sink). Anything else (steps with padded
prefills, act-order or asymmetric int8 weights, a layer's own attention
module not described for the stack, kernels not loaded yet)
runs the Python layers. `--enforce-eager` turns it off. Under tensor parallelism it computes a
rank's heads and slices and calls the ranks' all-reduce after each o and down projection (after
the experts' sum, and after the shared expert, in a MoE layer), as the Python layers do.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from octavo.distributed import parallel_state
from octavo.kernels import fused
from octavo.kernels.paged_attention import AttentionPlan
from octavo.model.context import ForwardContext, get_forward_context
from octavo.model.layer_spec import Activation, LayerSpec, NormKind
from octavo.model.layers.linear import Linear
from octavo.model.layers.lora import LoRASlots
from octavo.model.layers.norm import HeadLayerNorm, RMSNorm, UnitRMSNorm
from octavo.model.layers.rotary import PartialRotaryEmbedding, QueryTemperature, RotaryEmbedding
from octavo.model.quant.decode_weights import max_rows
from octavo.model.quant.microscaled import MicroscaledPacked
from octavo.model.quant.packed import Int4Packed, Int8Grouped, Int8Packed, PackedWeight
from octavo.model.quant.weights import DenseWeights, PackedWeights

# The low-bit kinds of octavo's int4 layout (csrc/stack_linear.h).
INT4_LAYOUT_KINDS = ("int4", "int4_int8", "int4_int16")

logger = logging.getLogger(__name__)


def unsupported_reason(layers: nn.ModuleList) -> str | None:
    """Why these decoder layers cannot run as one stack (None: they can)."""
    eps: set[float] = set()
    shapes: set[tuple[int, int, int]] = set()
    for layer in layers:
        if not hasattr(layer, "spec"):
            return f"layer type {type(layer).__name__}"
        spec: LayerSpec = layer.spec()
        if spec.mixer is not None and spec.latent is None and spec.delta_net is None:
            return f"attention of its own ({type(spec.mixer).__name__})"
        if spec.latent is not None and any(
                n is not None and type(n) is not RMSNorm
                for n in (spec.latent.q_a_norm, spec.latent.kv_a_norm)):
            return "a latent attention with norms other than RMSNorm"
        if spec.moe is not None and parallel_state.ep_dispatches():
            return "experts dispatched to other context-parallel ranks (all-to-all)"
        if spec.activation is None:
            return "an activation other than silu or gelu (tanh) gated, or silu, gelu or relu"
        if spec.rotary is not None and type(spec.rotary) not in (
                RotaryEmbedding, PartialRotaryEmbedding, QueryTemperature):
            return f"rotary embedding {type(spec.rotary).__name__}"
        if spec.norm_kind is NormKind.LAYER and any(n.weight is None for n in spec.norms):
            return "LayerNorms without a weight"
        for lin in _linears(spec):
            reason = _weight_reason(lin, spec.dtype)
            if reason is not None:
                return reason
        if any(type(n) is not _norm_module(spec, n) for n in spec.norms
               if not (spec.norm_kind is NormKind.RMS and type(n) is UnitRMSNorm)):
            return f"a norm other than {spec.norm_kind.module.__name__}"
        eps.update(n.eps for n in spec.norms)
        a = spec.attention
        if a is not None:  # a linear attention has none
            shapes.add((a.num_heads, a.num_kv_heads, a.head_dim))
    if len(eps) > 1:
        return "norm epsilons that differ between norms"
    if len(shapes) > 1:
        return "layers with different head counts or sizes"
    return None


def _norm_module(spec: LayerSpec, norm: nn.Module) -> type[nn.Module]:
    """The norm type the stack computes at `norm`'s place: the layer's kind, whose q/k norms
    are per-head LayerNorms beside LayerNorms (Cohere)."""
    if spec.norm_kind is NormKind.LAYER and norm in (spec.q_norm, spec.k_norm):
        return HeadLayerNorm
    return spec.norm_kind.module


def _linears(spec: LayerSpec) -> list[Linear | torch.Tensor]:
    """The layer's linear layers in the order the C++ stack takes them (DecodeStack.set_linears):
    qkv and o (a latent or linear attention's: its spec's linears), then the dense MLP's
    gate_up and down or the mixture of experts' (MoeSpec.linears; an expert of stacked dense
    weights is its weight tensor)."""
    described = spec.latent or spec.delta_net
    attention = [spec.qkv, spec.o] if described is None else described.linears
    mlp = [spec.gate_up, spec.down] if spec.moe is None else spec.moe.linears
    return [*attention, *mlp]


def _forms(lin: Linear | torch.Tensor
           ) -> tuple[torch.Tensor | None, PackedWeight | None] | None:
    """The two forms the stack computes a linear layer with: its dense weight (None: packed
    only) and a low-bit weight (its copy for small batches, or the packed weight alone); None
    for weights of another type."""
    if isinstance(lin, torch.Tensor):
        return lin, None
    if not isinstance(lin, Linear):  # a router of its own dtype (moe.FloatRouter)
        return lin.weight, None
    weights = lin.weights
    if isinstance(weights, DenseWeights):
        return weights.weight, weights.small_batch
    if isinstance(weights, PackedWeights):
        return None, weights.packed
    return None


def _weight_reason(lin: Linear | torch.Tensor, dtype: torch.dtype) -> str | None:
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
    if isinstance(low, Int4Packed) and low.dtype != dtype:
        return "int4 scales in another dtype"
    if isinstance(low, Int4Packed):
        return None if low.bits == 4 or low.kernel_ready(dtype, low.bits) else \
            f"{low.bits}-bit codes without octavo's bf16 int4 kernel"
    if isinstance(low, Int8Packed) and (low.q.shape[0] != 1 or low.zero_term is not None):
        return "a grouped or asymmetric int8 weight"
    if isinstance(low, (Int8Packed, Int8Grouped, MicroscaledPacked)):
        return None
    return f"a {type(low).__name__} weight"


def _row_limit(lin: Linear | torch.Tensor) -> int | None:
    """The most rows the stack computes of `lin` as its Python layer does (None: any)."""
    dense, low = _forms(lin)
    if (dense is not None or isinstance(low, (Int8Grouped, MicroscaledPacked))
            or _kind(low) in INT4_LAYOUT_KINDS):
        return None  # above its kernel's rows: the dense weight, or the packed one's tiles
    # The Python layer runs torch's int8 kernel for per-channel int8 above 8 rows, and tiles
    # above torch's int4 kernel's rows: the stack has neither.
    return 8 if isinstance(low, Int8Packed) else low.dense_rows


def _kind(low: PackedWeight | None) -> str:
    """The low-bit kind the C++ stack computes `low` as (csrc/stack_linear.h, LowBitKind)."""
    if isinstance(low, Int4Packed) and low.int16_product_ready(low.dtype):
        return "int4_int16"  # int16 activations up to dense_rows, int8 past them (4-, 5-bit)
    if isinstance(low, Int4Packed) and low.kernel_ready(low.dtype, low.bits):
        # large batches: int8-quantized activations (Int4Packed.large_batch_matmul) or tiles
        return "int4_int8" if low.int8_product_ready(low.dtype) else "int4"
    if isinstance(low, Int4Packed):
        return "int4_torch"
    if isinstance(low, MicroscaledPacked):
        return "microscaled"
    return "int8" if isinstance(low, (Int8Packed, Int8Grouped)) else "none"


def _biases(spec: LayerSpec) -> list[torch.Tensor | None]:
    """The bias of each of _linears(spec): a Linear's own, and a mixture's experts' (FusedMoE
    keeps them: gpt-oss), the down projection's only where this rank adds it (once a row)."""
    biases = [getattr(lin, "bias", None) for lin in _linears(spec)]
    fused_moe = None if spec.moe is None else spec.moe.fused
    if fused_moe is not None and getattr(fused_moe, "w13_bias", None) is not None:
        down = fused_moe._adds_down_bias
        experts = [b for e in range(len(spec.moe.experts))
                   for b in (fused_moe.w13_bias[e], fused_moe.w2_bias[e] if down else None)]
        biases[len(biases) - len(experts):] = experts
    return biases


def _adapters(spec: LayerSpec) -> list[LoRASlots | None]:
    """The adapter slots of each of _linears(spec) (None: none; a mixture's experts keep theirs
    in FusedMoE.lora)."""
    slots = [getattr(lin, "lora", None) for lin in _linears(spec)]
    fused_moe = None if spec.moe is None else spec.moe.fused
    if fused_moe is not None and fused_moe.lora is not None:
        experts = [s for pair in fused_moe.lora for s in pair]
        slots[len(slots) - len(experts):] = experts
    return slots


def _linear(lin: Linear | torch.Tensor, bias: torch.Tensor | None,
            lora: LoRASlots | None) -> tuple:
    """A linear layer as the C++ stack takes it (csrc/stack_linear.h): dense weight, bias, the
    low-bit kind and its tensors (two; a wide int4 weight's high plane or a microscaled weight's
    code table; a microscaled weight's scale table), output features,
    the most rows the low-bit kernel serves (beside a dense weight: its copy's; alone: the
    packed weight's dense_rows, tiles above them), and its LoRA slots (A, B, which are in use)
    where LoRA is on."""
    dense, low = _forms(lin)
    kind, c, d = _kind(low), None, None
    if kind in INT4_LAYOUT_KINDS:  # octavo's kernels
        a, b, c = low.native_layout()
    elif kind == "microscaled":  # the block follows from the shapes
        a, b, c, d, _ = low.native_layout()
    elif kind == "int4_torch":  # torch's kernel, groups of 32
        a, b = low.torch_layout()
    elif isinstance(low, Int8Packed):
        a, b = low.q[0], low.scale[0]
    elif isinstance(low, Int8Grouped):  # scales [N, G]: the GEMV applies them per group
        a, b = low.q, low.scale
    else:
        a, b = None, None
    out = dense.shape[0] if dense is not None else low.out_features
    rows = 0 if low is None else max_rows(low) if dense is not None else low.dense_rows
    adapters = (None, None, None, [0, 0]) if lora is None else (lora.a, lora.b, lora.used_mask,
                                                                 lora.bounds)
    return dense, bias, kind, a, b, c, d, out, rows, *adapters


class DecodeStack:
    """Builds the C++ stack the first time a step can use it, for the KV caches of that step."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.specs: list[LayerSpec] = [layer.spec() for layer in layers]
        self.dtype = self.specs[0].dtype  # the activations it computes in
        # linear attention layers: a state moves over its request's tokens at once, or waits
        # in the layer's span buffers where they end in drafts
        self.delta_nets = [spec.delta_net for spec in self.specs if spec.delta_net is not None]
        self._stack: Any = None
        self._caches: list[torch.Tensor] | None = None
        # Tokens a step may have (packed-only layers compute small batches only); None: any.
        limits = [n for spec in self.specs for lin in _linears(spec)
                  if (n := _row_limit(lin)) is not None]
        self.max_tokens: int | None = min(limits) if limits else None

    def usable(self, x: torch.Tensor, plans: list[AttentionPlan], ctx: ForwardContext) -> bool:
        """plans: the step's plan, its sliding-window one and its chunked one (step_plans)."""
        caches = ctx.kv_caches
        return (all(not p.groups and p.decode is not None for p in plans)
                and fused.native_active(x) and x.dtype == self.dtype
                and (not caches or caches[0].dtype in (self.dtype, torch.float8_e4m3fn))
                and (self.max_tokens is None or x.shape[0] <= self.max_tokens)
                and (not self.delta_nets or ctx.batch_rows is not None))

    def rebuild(self) -> None:
        """Build the C++ stack anew at the next step: its layers hold the weights they were
        built with, and the model's weights were replaced (model/loader/gemm_packing.py)."""
        self.specs = [layer.spec() for layer in self.layers]
        self._stack, self._caches = None, None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, plans: list[AttentionPlan],
                 ctx: ForwardContext) -> torch.Tensor:
        if self._caches is not ctx.kv_caches:
            self._build(ctx.kv_caches)
        kernel_plans = [_kernel_plan(p) for p in plans]
        slots = plans[0].slot_mapping  # every plan's: they differ in what they read
        rows = lens = saves = drafts = None
        if self.delta_nets:
            fresh = ctx.batch_rows[ctx.num_computed == 0]
            for d in self.delta_nets if len(fresh) else ():
                d.states.start_fresh(fresh)
            rows = torch.from_numpy(ctx.batch_rows).to(torch.int64)
            lens = torch.from_numpy(ctx.layout.query_lens).to(torch.int64)
            if ctx.state_saves is not None:  # slots as rows of the state buffers
                saves = torch.from_numpy(ctx.state_saves).clone()
                saves[:, 2] += self.delta_nets[0].states.first_checkpoint
            if ctx.num_drafts is not None:
                drafts = torch.from_numpy(ctx.num_drafts).to(torch.int64)
        lora = ctx.lora
        if lora is None:
            return self._stack.forward(x, positions, slots, kernel_plans, None, [], rows, lens,
                                       saves, drafts)
        return self._stack.forward(x, positions, slots, kernel_plans, lora.token_slot,
                                   lora.slots, rows, lens, saves, drafts)

    def _build(self, kv_caches: list[torch.Tensor]) -> None:
        attns = [spec.attention for spec in self.specs if spec.attention is not None]
        heads = ((attns[0].num_heads, attns[0].num_kv_heads, attns[0].head_dim) if attns
                 else (0, 0, 0))  # a pipeline stage of linear attention layers only
        stack = fused.native_module().DecodeStack(*heads, self.specs[0].norms[0].eps)
        if parallel_state.tp_size() > 1:  # the row-parallel projections' partial sums
            stack.set_all_reduce(parallel_state.TP_ALL_REDUCE_OP)
        for spec in self.specs:
            attn = spec.attention
            rope = isinstance(spec.rotary, RotaryEmbedding)
            cos, sin = (spec.rotary.cos, spec.rotary.sin) if rope else (None, None)
            sinks = None if attn is None or attn.sinks is None else attn.sinks.float()
            stack.add_layer(None if attn is None else kv_caches[attn.layer_index], cos, sin,
                            spec.scale, spec.softcap or 0.0, _plan_name(spec),
                            1.0 if attn is None else attn.k_scale,
                            1.0 if attn is None else attn.v_scale, sinks)
            if spec.output_gate:
                stack.set_output_gate()
            if isinstance(spec.rotary, QueryTemperature):
                stack.set_query_temperature(spec.rotary.floor_scale, spec.rotary.attn_scale)
            norms = (spec.attn_in_norm, spec.attn_out_norm, spec.mlp_in_norm, spec.mlp_out_norm)
            stack.set_norms(spec.norm_kind.value,
                            [_norm_weight(spec, n) for n in (*norms, spec.q_norm, spec.k_norm)],
                            [_norm_bias(spec, n) for n in norms], spec.parallel_residual,
                            spec.qk_norm_kind, spec.residual_scale)
            # One list per StackLinear field, over the layer's linear layers (_linears).
            stack.set_linears(*[list(field) for field in zip(*map(
                _linear, _linears(spec), _biases(spec), _adapters(spec)))])
            act_params = ([spec.act.alpha, spec.act.limit]
                          if spec.activation is Activation.CLAMPED_SWIGLU else [])
            if spec.latent is not None:
                a = spec.latent
                stack.set_latent(None if a.q_a_norm is None else a.q_a_norm.weight,
                                 a.kv_a_norm.weight, 0.0 if a.q_a_norm is None else
                                 a.q_a_norm.eps, a.kv_a_norm.eps, a.kv_b, a.nope, a.rope,
                                 a.v_dim)
            if spec.delta_net is not None:
                d = spec.delta_net
                stack.set_delta_net(d.qkvz_split, d.conv, d.a_log, d.dt_bias, d.norm.weight,
                                    d.norm.eps, d.k_heads, d.v_heads, d.dk, d.dv, d.chunk,
                                    d.states.conv_state, d.states.ssm_state)
                if d.states.span_seq is not None:
                    stack.set_delta_net_spans(d.states.span_seq, d.states.span_conv,
                                              d.states.span_beta, d.states.span_g)
            if spec.moe is not None:
                r = spec.moe.routing
                stack.set_routing(r.top_k, r.renormalize, spec.moe.fused.weigh_inputs,
                                  r.scoring, r.choose_by, r.scale,
                                  r.groups, r.keep_groups, r.group_score, r.correction)
            stack.set_mlp(spec.activation.value, spec.gated, *_moe_settings(spec), act_params)
        self._stack, self._caches = stack, kv_caches


def _moe_settings(spec: LayerSpec) -> tuple:
    """The shared expert (none, plain or gated), the experts the layer holds (the first's index
    and the mixture's count), and the count of rows routed to each expert it adds to
    (FusedMoE.routed), if any."""
    moe = spec.moe
    if moe is None:
        return "none", 0, 0, None
    shared = ("none" if moe.shared_gate_up is None else
              "plain" if moe.shared_gate is None else "gated")
    return (shared, moe.first_expert, moe.num_experts or len(moe.experts),
            getattr(moe.fused, "routed", None))


def _plan_name(spec: LayerSpec) -> str:
    if spec.window:
        return "sliding"
    return "chunked" if spec.attention and spec.attention.chunk is not None else "step"


def _kernel_plan(plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    d = plan.decode
    return d.token_index, d.block_table, d.seq_lens, d.window or 0


def _norm_bias(spec: LayerSpec, norm: nn.Module | None) -> torch.Tensor | None:
    return norm.bias if norm is not None and spec.norm_kind is NormKind.LAYER else None


def _norm_weight(spec: LayerSpec, norm: nn.Module | None) -> torch.Tensor | None:
    """A norm's weight as the C++ stack applies it: Gemma's 1 + w in float32, the tensor
    GemmaRMSNorm applies (plus_one)."""
    if norm is None:
        return None
    return norm.plus_one() if spec.norm_kind is NormKind.ONE_PLUS else norm.weight


def attach(model: nn.Module) -> DecodeStack | None:
    """Give `model` (a causal LM whose inner model has `layers` and a `decode_stack` slot) a
    decode stack if its layers allow one."""
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


def step_plans(ctx: ForwardContext) -> list[AttentionPlan]:
    """The plans the stack's layers read by index (csrc/stack_layer.h, plan_index): the step's,
    the sliding-window one and the chunked one, each the step's where the step has none, as
    PagedAttention reads them; the step's at the end are left off (the stack reads plan 0 past
    the list), so a step of most models converts one plan."""
    plans = [ctx.plan, ctx.sliding_plan or ctx.plan, ctx.chunked_plan or ctx.plan]
    while len(plans) > 1 and plans[-1] is ctx.plan:
        plans.pop()
    return plans


def run_layers(layers: nn.ModuleList, stack: DecodeStack | None, x: torch.Tensor,
               positions: torch.Tensor, compiled: Callable | None = None) -> torch.Tensor:
    """The decoder layers over x: as one C++ stack where the step allows it, else as their
    compiled graph (model/compiled.py) where there is one, else one by one."""
    ctx = get_forward_context()
    if stack is not None and ctx.context_parallel is None:
        plans = step_plans(ctx)
        if stack.usable(x, plans, ctx):
            return stack(x, positions, plans, ctx)
    if compiled is not None:
        return compiled(layers, positions, x)
    for layer in layers:
        x = layer(positions, x)
    return x
