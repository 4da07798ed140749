"""Which quantization a model loads with, and which of its linear layers get which method.

A checkpoint's `quantization_config` (config.json) names its format: gptq, awq, fp8,
compressed-tensors (FP8 or NVFP4), mxfp4 (gpt-oss's experts), modelopt (FP8, NVFP4, MXFP8; or
hf_quant_config.json's `quantization`, as ModelOpt's older exports write it).
`--quantization int8|int4|fp8` quantizes an unquantized checkpoint at load;
asking for it on a checkpoint that is quantized already is a ValueError naming the field. On a
GGUF, int4/int8 mean "its own codes in that layout, no dense copy" (quant/gguf.py). The
layers of a quantized checkpoint are the ones whose tensors carry the format's marker (`qweight`,
`weight_scale`); the rest (the LM head, MoE routers) stay dense. On-the-fly quantization takes
every linear layer of the decoder except MoE routers; embeddings and the LM head stay dense.
MoE experts take the same methods, one Linear per expert (layers/moe.py).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from octavo.model.layers.moe import EXPERT_TENSOR
from octavo.model.quant.base import ROUTERS, CheckpointMethod, OnTheFlyMethod, QuantMethod
from octavo.model.quant.fp8 import FP8Spec, quantize_fp8
from octavo.model.quant.gguf import GGUFPlan, gguf_plan
from octavo.model.quant.gptq import GPTQSpec
from octavo.model.quant.microscaled import MXSpec, NVFP4Spec, nvfp4_groups
from octavo.model.quant.packed import quantize_int4, quantize_int8
from octavo.model_source import ModelSource

logger = logging.getLogger(__name__)

ON_THE_FLY = ("int8", "int4", "fp8")
INT4_GROUP = 32  # on-the-fly int4: min/max per 32 inputs (SmolLM2 perplexity: docs/usage.md)
_MARKERS = {"gptq": (".qweight",), "awq": (".qweight",), "fp8": (".weight_scale",
            ".weight_scale_inv"), "compressed-tensors": (".weight_scale",),
            "mxfp4": ("_blocks",), "modelopt": (".weight_scale",),
            # FBGEMM's: a linear layer's weight_scale, stacked experts' <projection>_scale
            "fbgemm_fp8": (".weight_scale", "_scale")}


def checkpoint_quantization(source: ModelSource) -> dict[str, Any] | None:
    """config.json's quantization_config of a Hugging Face folder (None for GGUF or none)."""
    if source.is_gguf:
        return None
    path = source.path / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    modelopt = source.path / "hf_quant_config.json"
    if not qc and modelopt.is_file():
        qc = {"quant_method": "modelopt",
              **(json.loads(modelopt.read_text()).get("quantization") or {})}
    return qc or None


class QuantPlan:
    """What the loader applies: a format name and the method of each chosen linear layer."""

    required = True  # the model cannot load without its methods (GGUFPlan's may be dropped)

    def __init__(self, fmt: str, dtype: torch.dtype, *,
                 spec: GPTQSpec | FP8Spec | MXSpec | NVFP4Spec | None = None,
                 on_the_fly: str | None = None) -> None:
        self.fmt, self.dtype, self.spec, self.on_the_fly = fmt, dtype, spec, on_the_fly

    def method(self, layer: nn.Module) -> QuantMethod | None:
        if self.spec is not None:
            return CheckpointMethod(self.fmt, self.spec.build, self.dtype)
        if self.on_the_fly == "int8":
            return OnTheFlyMethod("int8", quantize_int8, self.dtype)
        if self.on_the_fly == "int4":
            if layer.in_features % INT4_GROUP:
                return None  # the int4 kernel needs whole groups: this layer stays dense
            return OnTheFlyMethod("int4", lambda w, dt: quantize_int4(w, INT4_GROUP, dt),
                                  self.dtype)
        return OnTheFlyMethod("fp8", quantize_fp8, self.dtype)

    def layers(self, model: nn.Module, checkpoint_names: Iterable[str]) -> dict[str, nn.Module]:
        """Model module name -> the Linear layers this plan quantizes."""
        modules = dict(model.named_modules())
        linears = {n: m for n, m in modules.items()  # Linear layers and MoE experts
                   if hasattr(m, "set_quant_method") or hasattr(m, "quantize_experts")}
        if self.on_the_fly is not None:
            return {n: m for n, m in linears.items() if not n.endswith(ROUTERS)}
        chosen = {}
        for ckpt in checkpoint_names:
            marker = next((m for m in _MARKERS[self.fmt] if ckpt.endswith(m)), None)
            if marker is None:
                continue
            name = model.linear_name(ckpt.removesuffix(marker) + ".weight")
            expert = EXPERT_TENSOR.match(f"{name}.weight") if name else None
            if expert:
                name = f"{expert[1]}.experts"
            if name in linears:
                chosen[name] = linears[name]
            elif name is not None and not getattr(modules.get(name), "reads_dequantized", False):
                raise NotImplementedError(
                    f"{self.fmt} tensor {ckpt}: quantized weights are supported on linear layers "
                    f"only, not on {name}")
        return chosen

    def apply(self, model: nn.Module, checkpoint_names: Iterable[str]) -> set[str]:
        """Before loading: give the chosen layers their methods. Returns the checkpoint names
        whose integer codes the loader should yield beside their weights: none here (GGUFPlan's
        have some)."""
        count = 0
        for layer in self.layers(model, checkpoint_names).values():
            if hasattr(layer, "quantize_experts"):
                count += layer.quantize_experts(self.method)
                continue
            method = self.method(layer)
            if method is not None:
                layer.set_quant_method(method)
                count += 1
        logger.info("quantization %s: %d linear layers", self.fmt, count)
        return set()

    def finish_lm_head(self, model: nn.Module, bits: dict[str, int], codes=None) -> None:
        """The LM head keeps its dense weight: checkpoints quantize linear layers only."""


def plan_quantization(source: ModelSource, requested: str | None, dtype: torch.dtype,
                      decode_weights: str = "auto", dense_prefill: bool = False
                      ) -> QuantPlan | GGUFPlan | None:
    """The plan for this checkpoint and --quantization (None: everything dense). A GGUF's is
    a GGUFPlan (quant/gguf.py): its own codes, with or without the dense weights."""
    if source.is_gguf:
        return gguf_plan(requested, decode_weights, dtype, dense_prefill)
    qc = checkpoint_quantization(source)
    if requested is not None:
        if requested not in ON_THE_FLY:
            raise ValueError(f"quantization must be one of {', '.join(ON_THE_FLY)}, "
                             f"got {requested!r}")
        if qc is not None:
            raise ValueError(
                f"quantization={requested!r} asks to quantize at load, but the checkpoint is "
                f"already quantized ({qc.get('quant_method')!r} in config.json's "
                "quantization_config); omit quantization to use the checkpoint's own")
        return QuantPlan(requested, dtype, on_the_fly=requested)
    if qc is None:
        return None
    fmt = str(qc.get("quant_method", "")).lower()
    if fmt in ("gptq", "awq"):
        return QuantPlan(fmt, dtype, spec=GPTQSpec(fmt, qc))
    if fmt == "compressed-tensors" and nvfp4_groups(qc):
        return QuantPlan(fmt, dtype, spec=NVFP4Spec(qc))
    if fmt in ("fp8", "compressed-tensors", "fbgemm_fp8"):
        return QuantPlan(fmt, dtype, spec=FP8Spec(fmt, qc))
    if fmt == "mxfp4":
        return QuantPlan(fmt, dtype, spec=MXSpec(qc, "mxfp4"))
    if fmt == "modelopt":
        return QuantPlan(fmt, dtype, spec=_modelopt_spec(qc))
    raise NotImplementedError(f"quantization_config.quant_method={fmt!r} is not supported; "
                              "supported: gptq, awq, fp8, compressed-tensors, fbgemm_fp8, mxfp4, "
                              "modelopt")


def _modelopt_spec(qc: dict[str, Any]) -> FP8Spec | NVFP4Spec | MXSpec:
    algo = str(qc.get("quant_algo", "")).upper()
    if algo == "FP8":  # a scale per tensor; the activations' input_scale is not needed
        return FP8Spec("fp8", {})
    if algo == "NVFP4":
        if qc.get("group_size", 16) != 16:
            raise NotImplementedError(f"quantization_config.group_size={qc['group_size']!r}: "
                                      f"NVFP4 takes groups of 16")
        return NVFP4Spec(qc, modelopt=True)
    if algo == "MXFP8":
        return MXSpec(qc, "mxfp8")
    raise NotImplementedError(f"quantization_config.quant_algo={qc.get('quant_algo')!r} "
                              f"(modelopt) is not supported; supported: FP8, NVFP4, MXFP8")
