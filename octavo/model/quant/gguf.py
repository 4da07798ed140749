"""GGUF weights kept quantized: each linear layer's GGML type mapped onto octavo's int4/int8 paths.

Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and Q4_K (per 32 weights w = d * sc * q - dmin * m)
are 4-bit codes with a scale and an offset per 32 inputs: exactly torch's int4 layout with group
32, so those codes and scales are copied over, not re-quantized (only scale and torch's zero,
8 * scale + offset, are rounded to the activation dtype). Q5_0 (w = d * q - 16 d, q 0..31) and
Q8_0 (w = d * q - 128 d, q 0..255 unsigned) are the same form with wider codes: where octavo's int4
kernel runs (Int4Packed.kernel_ready: bf16 or float32), a layer of Q5_0 (and Q4) slots keeps them
in that layout with a plane of fifth bits (6 bits a weight against the file's 5.5; int8 codes took
8.5), one with a Q8_0 slot with a plane of high nibbles (the int4 kernel twice: 1.6x the int8 GEMV
at 4 rows on a 168M-weight LM head, AMD EPYC AVX-512). The other types go to the nearest layout the
kernels have: Q6_K (w = d * sc * (q - 32) per 16), and Q8_0 / Q5_0 beside it or without that kernel
(the C++ kernels off), to int8 codes with a scale per 32 (16 for a layer with a Q6_K slot)
inputs (`Int8Grouped`), their codes and scales taken from the file (int8_codes: the same weights
bit for bit); Q5_1/Q5_K to int8 per 32, re-quantized; Q2_K/Q3_K to int4 min/max per
32; MXFP4 (gpt-oss's experts) keeps its codes and scales as a microscaled weight. Measured on
Qwen2.5-0.5B's Q4_K_M file
(relative Frobenius error against the GGUF's own weights): int8 per 32 Q8_0 0%, and before it
existed, int8 per channel Q8_0 1.8%, Q6_K 1.6%, Q5_0 1.1%; int4 min/max Q8_0 10.6%, Q5_0 8.5%,
Q6_K 8.2% (Q4_K would be 4.3%; it is copied, 0%). Perplexity:
tests/model/test_quant_perplexity.py. A packed layer takes the layout of its widest slot (q/k/v,
gate/up). Each choice is logged once per GGML type at load.

Modes (`GGUFPlan`): "auto" (the default on the CPU, bf16 or float32) takes each layer's nearest
layout, "int4" / "int8" (--quantization) that one for every layer. Only the packed weights are
kept, the linear layers', MoE experts', embedding's and LM head's, and every batch runs on them
(PackedWeight.matmul: packed kernels for small batches, dequantized tiles into the dense GEMM
for large ones), so the weights take about the file's size. With --dense-prefill-weights, auto
keeps the dense weights for prefill beside the packed copies for batches of up to max_rows rows
(decode_weights.py), the plan of old, 2.7-6x the file.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from octavo.model.layers.embedding import Embedding
from octavo.model.layers.moe import EXPERT_TENSOR
from octavo.model.quant.base import (
    ROUTERS,
    Loading,
    QuantMethod,
    dense_destination,
    load_dense,
)
from octavo.model.quant.decode_weights import make_decode_weight
from octavo.model.quant.ggml_codes import affine_codes, int8_codes
from octavo.model.quant.ggml_types import GGMLType as Q
from octavo.model.quant.microscaled import FP4_VALUES, MicroscaledPacked, e8m0_table
from octavo.model.quant.packed import (
    Int4Packed,
    Int8Grouped,
    PackedWeight,
    minmax_int4,
    quantize_int8,
    quantize_int8_grouped,
)
from octavo.model.quant.weights import DenseWeights, PackedWeights

logger = logging.getLogger(__name__)

GROUP = 32
INT4_EXACT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
_INT8_NEAREST = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)
_INT4_NEAREST = (*INT4_EXACT, Q.Q2_K, Q.Q3_K)
# checkpoint kinds the loader yields beside `weight` for INT4_EXACT tensors (and Q5_0 / Q8_0 in
# the wide int4 layouts): [N, K] codes 0..15 (0..31, 0..255), and [N, K / 32] scale and offset
# (w = scale * q + offset)
CODE_KINDS = ("gguf_q4", "gguf_q4_scale", "gguf_q4_low")
# Types whose codes are int8 values times one scale per 32 (Q8_0, Q5_0) or 16 (Q6_K) inputs: kept
# code for code as `Int8Grouped` (the loader yields these kinds: [N, K] int8 codes, [N, K / group]
# float32 scales), where re-quantizing their dequantized weights to int8 per 32 moved them by
# 0.5% (Gemma 3's Q5_0 and Q6_K), enough to move prompt logprobs by 0.13 against transformers.
INT8_EXACT = (Q.Q8_0, Q.Q5_0, Q.Q6_K)
CODE8_KINDS = ("gguf_q8", "gguf_q8_scale")
# MXFP4 (gpt-oss's experts): e2m1 codes [N, K / 2] in the OCP nibble order and e8m0 scale bytes
# [N, K / 32], kept as they are (quant/microscaled.py)
MX_KINDS = ("gguf_mx", "gguf_mx_scale")
# How the loader yields a weight whose codes a layer keeps (the kinds it gives in its place).
CODE_FORMS = {"int4": CODE_KINDS, "int8": CODE8_KINDS, "mx": MX_KINDS}
# Wider codes in octavo's int4 layout (Int4Packed with a high plane, bf16): the types each width
# keeps code for code (a narrower code is a wider one with high bits 0), by target.
_WIDE_INT4 = {"int4:5bit": (5, (*INT4_EXACT, Q.Q5_0)),
              "int4:8bit": (8, (*INT4_EXACT, Q.Q5_0, Q.Q8_0))}


def _target(mode: str, types: list[Q], in_features: int, dtype: torch.dtype) -> str | None:
    """The layout of a layer whose slots have GGML `types`; None: no packed weight."""
    if mode != "auto":
        return "int4" if mode == "int4" and in_features % GROUP == 0 else "int8"
    if in_features % GROUP:
        return None
    if all(t == Q.MXFP4 for t in types):
        return "mx"
    if all(t in _INT4_NEAREST for t in types):
        return "int4"
    wide = _wide_target(types, dtype)
    if wide is not None:
        return wide
    if all(t in _INT4_NEAREST + _INT8_NEAREST for t in types):
        return "int8"
    return None  # a float slot (F16, BF16, F32) or a type without a mapping: dense only


def _wide_target(types: list[Q], dtype: torch.dtype) -> str | None:
    """The narrowest wide int4 layout that keeps every one of `types` code for code, where
    octavo's kernel runs it with activations of `dtype`; None: none does."""
    for target, (bits, exact) in _WIDE_INT4.items():
        if all(t in exact for t in types) and Int4Packed.kernel_ready(dtype, bits):
            return target
    return None


def _how(qtype: Q, target: str, in_features: int, exact_int8: bool) -> str:
    if target == "mx":
        return "MXFP4 codes and scales kept (exact)"
    if target in _WIDE_INT4:
        return (f"int4 layout with {_WIDE_INT4[target][0]}-bit codes, its codes, scales and "
                f"offsets copied (exact)")
    if target == "int4" and qtype in INT4_EXACT:
        return "int4 group 32, its codes, scales and offsets copied (exact)"
    if target == "int4":
        return "int4 group 32, re-quantized (min/max per 32) from the dequantized weights"
    if in_features % GROUP:
        return (f"int8 per output channel, re-quantized from the dequantized weights "
                f"(in_features {in_features} is not a multiple of 32)")
    if exact_int8:
        return f"int8 group {16 if qtype == Q.Q6_K else 32}, its codes and scales kept (exact)"
    return "int8 group 32, re-quantized (absmax per 32) from the dequantized weights"


class GGUFMethod(QuantMethod):
    """A linear layer from GGUF tensors of `types` (one per slot): packed `target` weights
    (`PackedWeights`), or with `keep_dense` the dense weight with them as its small-batch copy
    (`DenseWeights`, the dense GEMM above max_rows rows)."""

    def __init__(self, types: list[Q], target: str, keep_dense: bool,
                 dtype: torch.dtype) -> None:
        self.types, self.target, self.keep_dense, self.dtype = types, target, keep_dense, dtype

    def create_weights(self, layer: nn.Module) -> None:
        if self.keep_dense:  # created after the model, outside its default dtype
            dense_destination(layer, self.dtype)
        layer.loading = Loading()

    def _needs(self, slot: int) -> tuple[str, ...]:
        if self.target == "mx":
            return MX_KINDS
        if self.target in _WIDE_INT4 or self.target == "int4" and self.types[slot] in INT4_EXACT:
            return CODE_KINDS
        if self._int8_exact():
            return CODE8_KINDS
        return ("weight",)

    def _int8_exact(self) -> bool:
        """Every slot's int8 codes kept as they are (else all re-quantized per 32)."""
        return self.target == "int8" and all(t in INT8_EXACT for t in self.types)

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        if name not in ("weight", *CODE_KINDS, *CODE8_KINDS, *MX_KINDS):
            raise ValueError(f"checkpoint tensor {name!r} on a GGUF linear layer")
        if name == "weight" and self.keep_dense:
            load_dense(layer, index, tensor)
        slot = 0 if index is None else index
        loading = layer.loading
        if loading.built is not None or name not in self._needs(slot):
            return
        loading.parts.setdefault(slot, {})[name] = tensor
        if all(set(self._needs(s)) <= set(loading.parts.get(s, ()))
               for s in range(len(self.types))):
            loading.built = self._build([loading.parts[s] for s in range(len(self.types))])
            loading.parts = {}  # built as soon as its codes are in: the parts go at once

    def _build(self, parts: list[dict[str, torch.Tensor]]) -> PackedWeight:
        if self.target == "mx":
            return MicroscaledPacked(torch.cat([p["gguf_mx"] for p in parts]),
                                     torch.cat([p["gguf_mx_scale"] for p in parts]),
                                     torch.tensor(FP4_VALUES), e8m0_table(), 32, self.dtype)
        if self.target == "int8" and self._int8_exact():
            # One group for the layer: 16 where a slot is Q6_K, the others' scales repeated.
            group = 16 if Q.Q6_K in self.types else 32
            scales = [p["gguf_q8_scale"].float() for p in parts]
            scales = [sc.repeat_interleave(p["gguf_q8"].shape[1] // group // sc.shape[1], 1)
                      for sc, p in zip(scales, parts)]
            return Int8Grouped(torch.cat([p["gguf_q8"] for p in parts]), torch.cat(scales),
                               self.dtype)
        if self.target == "int8":
            w = torch.cat([p["weight"].float() for p in parts])
            return (quantize_int8_grouped(w, GROUP, self.dtype) if w.shape[1] % GROUP == 0
                    else quantize_int8(w, self.dtype))
        q, scale, low = zip(*[(p["gguf_q4"], p["gguf_q4_scale"], p["gguf_q4_low"])
                              if "gguf_q4" in p else minmax_int4(p["weight"], GROUP)
                              for p in parts])
        bits = _WIDE_INT4[self.target][0] if self.target in _WIDE_INT4 else 4
        return Int4Packed.from_affine(torch.cat(q), torch.cat(scale), torch.cat(low), GROUP,
                                      self.dtype, bits)

    def process_after_load(self, layer: nn.Module) -> None:
        built = layer.loading.built
        if built is None:
            raise ValueError(f"GGUF linear layer is missing tensors: slots loaded "
                             f"{sorted(layer.loading.parts)} of {len(self.types)}")
        layer.set_weights(DenseWeights(layer.weight.data, built) if self.keep_dense
                          else PackedWeights(built))


def _slot(model: nn.Module, ckpt_name: str
          ) -> tuple[str, int | tuple[int, ...] | None] | None:
    """(Linear module name, slot or slots) that a checkpoint weight fills, as load_weights
    routes it."""
    name = model.checkpoint_name(ckpt_name)
    if name is None or not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    owner, _, leaf = module.rpartition(".")
    if leaf in model.packed_modules_mapping:
        packed, slot = model.packed_modules_mapping[leaf]
        return (f"{owner}.{packed}" if owner else packed), slot
    return module, None


class GGUFPlan:
    """Which linear layers of a GGUF model get a `GGUFMethod`, in mode auto, int4 or int8, and
    whether the dense weights stay for prefill (`keep_dense`)."""

    def __init__(self, mode: str, dtype: torch.dtype, dense_prefill: bool = False) -> None:
        if mode not in ("auto", "int4", "int8"):
            raise ValueError(f"quantization for a GGUF must be int4 or int8, got {mode!r}")
        self.mode, self.dtype = mode, dtype
        self.keep_dense = mode == "auto" and dense_prefill
        self.fmt = f"gguf {mode}" + (" with dense prefill weights" if self.keep_dense else "")
        # auto is the CPU's best plan: a device without these kernels loads the dense weights.
        self.required = mode != "auto"

    def apply(self, model: nn.Module, tensor_types: dict[str, Q]) -> dict[str, str]:
        """Before loading: give the layers their methods; `tensor_types` maps each checkpoint
        weight name (stacked experts with {}) to its GGML type. Returns the checkpoint names
        whose codes the loader should yield, each with its form (CODE_FORMS)."""
        modules = dict(model.named_modules())
        slots: dict[str, dict[int | None, tuple[Q, str]]] = {}
        moe: dict[str, dict[str, tuple[Q, str]]] = {}  # stacked experts: block -> projection -> type
        for ckpt, qtype in tensor_types.items():
            m = EXPERT_TENSOR.match(ckpt.format(0)) if "{}" in ckpt else None
            if m:
                moe.setdefault(f"{m[1]}.experts", {})[m[3]] = (qtype, ckpt)
                continue
            where = _slot(model, ckpt)
            if where is not None and hasattr(modules.get(where[0]), "set_quant_method"):
                # a tensor over several slots (Qwen3-Next's attn_qkv) types each of them
                for slot in where[1] if isinstance(where[1], tuple) else [where[1]]:
                    slots.setdefault(where[0], {})[slot] = (qtype, ckpt)
        wants: dict[str, str] = {}
        logged: set[tuple[Q, str, bool]] = set()

        def method(layer: nn.Module, typed: list[tuple[Q, str]],
                   wanted: dict[str, str] = wants) -> GGUFMethod | None:
            """The layer's method, its checkpoint tensors' code forms put in `wanted`."""
            types = [t for t, _ in typed]
            target = _target(self.mode, types, layer.in_features, self.dtype)
            if target is None:
                return None
            exact_int8 = target == "int8" and all(t in INT8_EXACT for t in types)
            for t, ckpt in typed:
                if (t, target, exact_int8) not in logged:
                    logged.add((t, target, exact_int8))
                    logger.info("GGUF %s weights -> %s", t.name, _how(
                        t, target, layer.in_features, exact_int8))
                if target == "mx":
                    wanted[ckpt] = "mx"
                elif target in _WIDE_INT4 or target == "int4" and t in INT4_EXACT:
                    wanted[ckpt] = "int4"  # affine codes
                elif exact_int8:
                    wanted[ckpt] = "int8"
            return GGUFMethod(types, target, self.keep_dense, self.dtype)

        count = 0
        for name, typed in slots.items():
            layer = modules[name]
            if name.endswith(ROUTERS):
                continue  # MoE routers stay dense, as with on-the-fly quantization
            if None in typed:  # one tensor for every slot (Phi-3's attn_qkv), cut into its
                # slots where tensor parallelism takes a share of each (Linear.load_shard)
                ordered = [typed[None]] * (len(layer.shards) if layer.splits_packed_tensor else 1)
            elif sorted(typed) == list(range(len(layer.shards))):
                ordered = [typed[s] for s in sorted(typed)]
            else:
                continue  # slots not all in the file: load_weights reports what is missing
            chosen = method(layer, ordered)
            if chosen is not None:
                layer.set_quant_method(chosen)
                count += 1
        if not self.keep_dense:  # with dense prefill weights the experts stay dense
            for name, projs in moe.items():
                gate_up = [projs.get(p) for p in ("gate_proj", "w1", "up_proj", "w3")]
                gate_up = [t for t in gate_up if t is not None]
                down = projs.get("down_proj") or projs.get("w2")
                if len(gate_up) != 2 or down is None or name not in modules:
                    continue
                # the codes are wanted only where every projection takes a method (a rank's
                # share of a narrow expert may be below a kernel's block: all stay dense)
                pending: dict[str, str] = {}
                quantized = modules[name].quantize_experts(
                    lambda layer, g=gate_up, d=down, p=pending: method(
                        layer, g if len(layer.shards) == 2 else [d], p))
                if quantized:
                    wants.update(pending)
                count += quantized
        logger.info("quantization %s: %d linear layers", self.fmt, count)
        return wants

    def finish_lm_head(self, model: nn.Module, bits: dict[str, int],
                       table: Callable[[str], tuple[Q, torch.Tensor] | None] | None = None
                       ) -> None:
        """After loading: the LM head's low-bit copy, at the width of its checkpoint tensor
        (`bits`: bits per weight of each checkpoint weight; a tied head's is its embedding's).
        Without dense prefill weights, the embeddings and the head keep the file's own codes
        alone where they are exact (`table`: a checkpoint weight's GGML type and raw blocks
        [rows, row bytes] for Q8_0, Q5_0 and Q6_K, or None for other types;
        layers/embedding.py)."""
        per_module: dict[str, int] = {}
        for ckpt_name, b in bits.items():
            module = model.linear_name(ckpt_name)  # the module it fills (GPT-2: transformer.h...)
            if module is not None:
                per_module[module] = max(per_module.get(module, 0), b)  # the widest shard
        modules = dict(model.named_modules())
        head = modules.get("lm_head")
        if head is None or not hasattr(head, "set_decode_bits"):
            return
        if "lm_head" not in per_module and head.tied:  # its embedding's width
            per_module.update({"lm_head": b for name, b in per_module.items()
                               if getattr(modules.get(name), "weight", None) is head.weight})
        if "lm_head" in per_module:
            head.set_decode_bits(per_module["lm_head"])
        if self.keep_dense:
            return
        ckpt_of = {model.linear_name(c): c for c in bits}

        def exact(name: str, module: nn.Module) -> PackedWeight | None:
            """The module's rows as the file's own codes: 5- and 8-bit codes in the int4 layout
            for Q5_0 and Q8_0 (mode auto, where the bf16 int4 kernel runs: _wide_target), int8
            codes otherwise and for Q6_K; else a Q8_0 table re-quantized (code for code); None
            for other types, whose re-quantized rows would move every prompt."""
            got = table(ckpt_of[name]) if table is not None and name in ckpt_of else None
            if got is not None:
                qtype, raw = got
                first, rows = module.first_row, module.weights_shape[0]
                target = _wide_target([qtype], self.dtype) if self.mode == "auto" else None
                wide = _WIDE_INT4[target][0] if target is not None else None
                parts = [_rows_share(torch.from_numpy(np.ascontiguousarray(a)), first, rows)
                         for a in (affine_codes if wide else int8_codes)(qtype, raw.numpy())]
                if wide:
                    return Int4Packed.from_affine(*parts, GROUP, self.dtype, wide)
                return Int8Grouped(*parts, self.dtype)
            if per_module.get(name) == 8:
                return make_decode_weight(module.weights.weight, 8)
            return None

        for name, module in modules.items():
            if not isinstance(module, Embedding) or name not in per_module:
                continue
            tied = head.tied and module.weights.weight is head.weights.weight
            packed = exact(name, module)
            if packed is None:
                logger.info("%s (%d-bit source) stays dense: no exact packed form for its "
                            "type yet", name, per_module[name])
                continue
            module.set_weights(PackedWeights(packed))
            if tied:  # the head multiplies by the same codes
                head.set_weights(PackedWeights(packed))
        if not head.tied and isinstance(head.weights, DenseWeights):
            packed = exact("lm_head", head)
            if packed is not None:
                head.set_weights(PackedWeights(packed))
            elif self.mode != "auto":  # an explicit layout: its copy alone, as asked
                head.packed_only(None)


def _rows_share(t: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Rows first:first + rows of a vocabulary table, zeros past its end (a tensor-parallel
    rank's share, layers/embedding.py)."""
    part = t[first:first + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part.contiguous()


def gguf_plan(requested: str | None, decode_weights: str, dtype: torch.dtype,
              dense_prefill: bool = False) -> GGUFPlan | None:
    """--quantization int4|int8 on a GGUF: packed weights of that layout; unset: of each
    tensor's nearest layout (decode_weights=auto, bf16 or float32), with the dense weights
    beside them for `dense_prefill`; decode_weights=none: nothing (dense weights only)."""
    if requested is not None:
        if requested not in ("int4", "int8"):
            raise ValueError(f"quantization={requested!r} is not available for a GGUF (its "
                             "weights are integer codes): use int4 or int8, or omit it for the "
                             "dense weights with low-bit copies for decode")
        return GGUFPlan(requested, dtype)
    if decode_weights == "auto" and dtype in (torch.bfloat16, torch.float32):
        return GGUFPlan("auto", dtype, dense_prefill)
    return None

