"""A decoder layer described for the fused decode stack (model/decode_stack.py): which norms sit
where and how they apply their weight, whether the MLP reads the layer's input beside attention
(parallel residual), the attention's scale, window, softcap and RoPE tables, the MLP (gated or
plain, its activation, or a mixture of experts), and the modules holding the weights. Each
family's decoder layer builds its own (`spec()`) from what it already has; the stack reads
these, not layer types, and so do the Python layers (model/decoder_layer.py runs a spec op by
op): a family writes its layer once, as modules and their description."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from octavo.kernels import fused
from octavo.model.layers.activation import ClampedSwiGLU
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.linear import Linear
from octavo.model.layers.norm import GemmaRMSNorm, HeadLayerNorm, RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.layers.routing import Routing


class NormKind(enum.Enum):
    """How a layer's norms apply their weights; the values are the C++ stack's names
    (csrc/stack_layer.h, stack_norm_kind)."""

    RMS = "rms"  # x / rms(x), rounded to the dtype, times w
    ONE_PLUS = "one_plus"  # x / rms(x) times (1 + w) in float32, one rounding (Gemma)
    LAYER = "layer"  # LayerNorm with a bias (GPT-NeoX, GPT-2)

    @property
    def module(self) -> type[nn.Module]:
        return {"rms": RMSNorm, "one_plus": GemmaRMSNorm, "layer": nn.LayerNorm}[self.value]


class Activation(enum.Enum):
    """The MLP's activation: on the packed [gate | up] projection of a gated MLP (silu and
    gelu_tanh), else on the up projection; the values are the C++ stack's names
    (csrc/stack_layer.h, stack_activation)."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    GELU = "gelu"
    RELU = "relu"
    CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's, gated (layers/activation.py ClampedSwiGLU)


_GATED = {fused.silu_and_mul: Activation.SILU, fused.gelu_tanh_and_mul: Activation.GELU_TANH}
# config.json's hidden_act of a plain MLP (model/layers/activation.py computes each with the
# ATen op the stack calls).
_PLAIN = {"silu": Activation.SILU, "gelu": Activation.GELU, "gelu_new": Activation.GELU_TANH,
          "gelu_pytorch_tanh": Activation.GELU_TANH, "relu": Activation.RELU}


def plain_activation(hidden_act: str) -> Activation | None:
    return _PLAIN.get(hidden_act)


def gated_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> Activation | None:
    """The stack's name for a gated activation as the Python layers compute it (None: one the
    stack does not compute)."""
    return Activation.CLAMPED_SWIGLU if isinstance(act, ClampedSwiGLU) else _GATED.get(act)


@dataclass(frozen=True, eq=False)
class MoeSpec:
    """A mixture-of-experts MLP (model/layers/moe.py FusedMoE, with Qwen2-MoE's shared expert):
    each expert's gate_up and down projections are a Linear (quantized experts) or a slice of
    the stacked dense weights."""

    router: Linear | nn.Module  # hidden -> one logit per expert
    experts: list[tuple[Linear | torch.Tensor, Linear | torch.Tensor]]
    shared_gate_up: Linear | None  # the shared expert, else None
    shared_down: Linear | None
    shared_gate: Linear | None  # its sigmoid gate (Qwen2-MoE), or None: added whole (DeepSeek)
    fused: nn.Module  # the Python execution of the routed experts, grouped per step:
    # FusedMoE(x, router logits), with its `routing` (model/layers/routing.py)
    first_expert: int = 0  # `experts` are experts [first_expert, + len) of num_experts (expert
    num_experts: int = 0  # parallelism: this rank's); 0: len(experts)

    @property
    def routing(self) -> Routing:
        return self.fused.routing

    @property
    def linears(self) -> list[Linear | torch.Tensor]:
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate]
        return ([self.router] + [w for w in shared if w is not None]
                + [w for pair in self.experts for w in pair])


@dataclass(frozen=True, eq=False)
class LatentSpec:
    """DeepSeek's latent attention (model/layers/mla.py MlaAttention, which computes it for the
    Python layers) as the fused stack computes it: the query from q_proj, or from q_b_proj over
    the RMS-normed q_a_proj (q_a_norm); the latent row from kv_a_proj (kv_a_norm on its first
    rank features, RoPE on the rest); kv_b_proj's weight holds each head's W_UK and W_UV rows."""

    q_a: Linear | None  # the compressed query's projection, else None
    q_a_norm: nn.Module | None
    q: Linear  # q_b_proj, or q_proj where the query is not compressed
    kv_a: Linear
    kv_a_norm: nn.Module
    kv_b: torch.Tensor  # [heads * (nope + v_dim), rank]
    o: Linear
    nope: int
    rope: int
    v_dim: int

    @property
    def linears(self) -> list[Linear]:
        """In the order the C++ stack takes them (DecodeStack.set_latent), then o."""
        return [lin for lin in (self.q_a, self.q, self.kv_a) if lin is not None] + [self.o]


@dataclass(frozen=True, eq=False)
class DeltaNetSpec:
    """Qwen3-Next's Gated DeltaNet (model/layers/gated_delta_net.py GatedDeltaNet, which computes
    it for the Python layers and owns each request's state and span buffers) as the fused
    stack computes it: q | k | v and z from qkvz (grouped per key head unless qkvz_split), beta
    and the decay's input from ba, the causal convolution over the conv window, the delta rule
    on the state, the gated RMS norm, out."""

    qkvz: Linear
    ba: Linear
    out: Linear
    qkvz_split: bool
    conv: torch.Tensor  # [conv_dim, K]
    a_log: torch.Tensor  # [v_heads]
    dt_bias: torch.Tensor  # [v_heads]
    norm: nn.Module  # GatedRMSNorm: weight [d_v], eps
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    chunk: int  # prompt tokens a triangular solve takes at once
    states: nn.Module  # the layer: conv_state, ssm_state (set once the KV cache is), and
    # start_fresh(rows), which empties the states of requests that start at a step

    @property
    def linears(self) -> list[Linear]:
        """In the order the C++ stack takes them (DecodeStack.set_delta_net), then out."""
        return [self.qkvz, self.ba, self.out]


@dataclass(frozen=True, eq=False)
class LayerSpec:
    norm_kind: NormKind
    attn_in_norm: nn.Module | None  # before attention (None: none, OLMo 2's post-norms only)
    attn_out_norm: nn.Module | None  # on the o projection's output (Gemma's sandwich), else None
    mlp_in_norm: nn.Module | None  # before the MLP
    mlp_out_norm: nn.Module | None  # on the down projection's output (sandwich), else None
    q_norm: nn.Module | None  # before RoPE: per head (Qwen3, Gemma 3), or over all of a token's
    k_norm: nn.Module | None  # heads where qk_norm_whole (OLMo 2)
    qkv: Linear | None  # the projections; their biases come with them (None: a mixer's)
    o: Linear | None
    gate_up: Linear | None  # the MLP's input projection ([gate | up] where gated); None: MoE
    down: Linear | None
    activation: Activation | None  # None: one the stack does not compute
    attention: PagedAttention | None  # heads, cache layer index (None: a mixer's own state)
    rotary: RotaryEmbedding | None  # this layer's tables (Gemma 3's local layers have their
    # own base); None: no rotary (GPT-2's positions are learned, added before the layers)
    scale: float
    window: int | None  # sliding window (the layer reads the step's sliding plan), else None
    softcap: float | None
    moe: MoeSpec | None = None  # the MLP as a mixture of experts, else None
    gated: bool = True  # the MLP's activation multiplies gate by up
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm'(x)) (GPT-NeoX)
    act: Callable[[torch.Tensor], torch.Tensor] | None = None  # the activation as the Python
    # layers compute it (on [gate | up] where gated; a mixture's shared expert takes the
    # experts')
    residual_scale: float = 1.0  # each sublayer's output scaled before the residual add (Granite)
    qk_norm_whole: bool = False  # q_norm / k_norm span all of a token's q / k heads (OLMo 2)
    # The attention as a module of its own, mixer(positions, x) -> the o projection's output
    # (DeepSeek's latent attention, Qwen3-Next's linear one), in place of the described q/k/v
    # one (then qkv and o are None); the fused stack takes it where it is described (`latent`).
    mixer: nn.Module | None = None
    # The q projection holds each head's query and an output gate (Qwen3-Next): the attention's
    # output times sigmoid(gate), before the o projection
    output_gate: bool = False
    latent: LatentSpec | None = None  # the mixer described, where the stack computes it (MLA)
    delta_net: DeltaNetSpec | None = None  # or a linear attention's (Qwen3-Next)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights are in it)."""
        return self.norms[0].weight.dtype

    @property
    def qk_norm_kind(self) -> str:
        """How q_norm and k_norm apply, by the C++ stack's names (csrc/stack_layer.h,
        stack_qk_norm): RMS norms per head or over all heads, or LayerNorms per head."""
        if self.qk_norm_whole:
            return "whole"
        return "head_layer" if isinstance(self.q_norm, HeadLayerNorm) else "head"

    @property
    def norms(self) -> list[nn.Module]:
        return [n for n in (self.attn_in_norm, self.attn_out_norm, self.mlp_in_norm,
                            self.mlp_out_norm, self.q_norm, self.k_norm) if n is not None]


def decoder_spec(self_attn: nn.Module, mlp: nn.Module, norm_kind: NormKind,
                 attn_in_norm: nn.Module | None, mlp_in_norm: nn.Module | None,
                 attn_out_norm: nn.Module | None = None,
                 mlp_out_norm: nn.Module | None = None, *, parallel_residual: bool = False,
                 residual_scale: float = 1.0, latent: LatentSpec | None = None,
                 delta_net: DeltaNetSpec | None = None) -> LayerSpec:
    """The spec of a layer whose attention has qkv_proj, o_proj, q_norm, k_norm (and
    qk_norm_whole, output_gate), rotary and a PagedAttention `attn` (an attention without
    qkv_proj is a mixer, computed whole: it has only its `attn`, or none where it keeps a state
    of its own), and whose MLP has gate_up_proj, down_proj and a gated `act`, or is a mixture of
    experts that describes itself (`moe_spec()`, with its experts' gated `act`)."""
    attn = getattr(self_attn, "attn", None)
    moe = mlp.moe_spec() if hasattr(mlp, "moe_spec") else None
    gate_up, down = (None, None) if moe is not None else (mlp.gate_up_proj, mlp.down_proj)
    act = mlp.experts.act if moe is not None else mlp.act
    mixer = None if hasattr(self_attn, "qkv_proj") else self_attn
    described = (getattr(self_attn, name, None) if mixer is None else None
                 for name in ("q_norm", "k_norm", "qkv_proj", "o_proj"))
    return LayerSpec(
        norm_kind, attn_in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm, *described,
        gate_up, down, gated_activation(act), attn,
        self_attn.rotary if mixer is None or latent is not None else None,
        1.0 if attn is None else attn.scale, attn and attn.sliding_window or None,
        attn and attn.softcap or None, moe, parallel_residual=parallel_residual, act=act,
        residual_scale=residual_scale, qk_norm_whole=getattr(self_attn, "qk_norm_whole", False),
        mixer=mixer, output_gate=getattr(self_attn, "output_gate", False), latent=latent,
        delta_net=delta_net)
