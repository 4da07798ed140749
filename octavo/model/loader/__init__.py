"""Build a model and stream its checkpoint tensors (safetensors or GGUF) into it.

The formats differ only in how their files are checked and read (`_Safetensors`, `_GGUF`): what
the quantization plan learns of the tensors before loading, the tensors themselves, and whether
the loaded model is worth keeping on disk (a GGUF's dequantized and repacked weights are: see
prepared_cache). Everything else is the same for both: the plan hands linear layers their quant
methods, each layer's method turns the tensors it got into its weights (model/quant), and on the
CPU dense bf16 weights are packed for oneDNN's GEMM (gemm_packing)."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.quant.ggml_types import GGMLType
from octavo.model.registry import model_class
from octavo.model_source import ModelSource


class _Safetensors:
    prepared = False  # read as stored: nothing to keep

    def __init__(self, source: ModelSource, cfg: ArchConfig) -> None:
        self.path = source.path
        self.bits: dict[str, int] = {}
        self.names: list[str] = []

    def check(self) -> None:
        from octavo.model.loader.safetensors_weights import safetensors_names
        self.names = safetensors_names(self.path)  # safetensors checks each header and range

    def plan_input(self) -> list[str]:
        return self.names

    def table(self, name: str) -> None:
        return None  # dense tensors: no codes to keep

    def tensors(self, codes: dict[str, str], plan) -> Iterator[tuple[str, torch.Tensor]]:
        from octavo.model.loader.safetensors_weights import iterate_safetensors_weights
        return iterate_safetensors_weights(self.path)


class _GGUF:
    prepared = True  # dequantizing and packing take seconds: the result is kept

    def __init__(self, source: ModelSource, cfg: ArchConfig) -> None:
        self.path, self.cfg = source.path, cfg
        self.bits: dict[str, int] = {}  # bits per weight of each tensor, filled as it is read

    def check(self) -> None:
        from octavo.model_files import check_gguf
        check_gguf(self.path)

    def plan_input(self) -> dict:
        from octavo.model.loader.gguf_weights import gguf_tensor_types
        return gguf_tensor_types(self.path, self.cfg)

    def table(self, name: str) -> tuple[GGMLType, torch.Tensor] | None:
        from octavo.model.loader.gguf_weights import gguf_table
        return gguf_table(self.path, self.cfg, name)

    def tensors(self, codes: dict[str, str], plan) -> Iterator[tuple[str, torch.Tensor]]:
        from octavo.model.loader.gguf_weights import iterate_gguf_weights
        return iterate_gguf_weights(self.path, self.cfg, self.bits, codes,
                                    dense_too=plan is None or plan.keep_dense)


def load_model(source: ModelSource, cfg: ArchConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int,
               decode_weights: str = "auto", quantization: str | None = None,
               pack_gemm: bool = True, dense_prefill: bool = False,
               quantized_activations: bool = False, model_impl: str = "auto") -> nn.Module:
    """Build the model and fill it. A GGUF's linear layers, embedding and LM head keep packed
    int4/int8 weights made from its codes (model/quant/gguf.py), with decode_weights="auto" (on
    the CPU, bf16 or float32) in the layout nearest each tensor's type, with `quantization`
    int4 or int8 in that one; with `dense_prefill` the dense weights stay beside them for
    prefill; with `quantized_activations` packed weights may take their activations quantized
    (PackedWeight.quantized_activations: `--dtype auto`'s plan); `model_impl` picks octavo's
    native file or the transformers backend (registry.model_class). A quantized checkpoint
    (config.json's quantization_config) or `quantization` (int8, int4, fp8: quantize at load)
    hands linear layers their quant methods before the tensors stream in (see model/quant).
    On the CPU, dense bf16 weights are packed for oneDNN's GEMM unless `pack_gemm` is False: the
    caller then packs them itself, e.g. step by step (gemm_packing.StepwisePacking)."""
    from octavo.model.quant.config import plan_quantization
    plan = plan_quantization(source, quantization, dtype, decode_weights, dense_prefill)
    if plan is not None and device.type != "cpu":
        if not plan.required:
            plan = None  # the decode copies are a CPU matter: dense weights elsewhere
        else:
            raise NotImplementedError(f"quantized weights ({plan.fmt}) run on the CPU only; "
                                      f"device={device.type}")
    cls = model_class(cfg.architecture, model_impl)
    checkpoint = _GGUF(source, cfg) if source.is_gguf else _Safetensors(source, cfg)
    prepared = None
    if checkpoint.prepared and device.type == "cpu":
        from octavo.model.loader.prepared_cache import prepared_path
        prepared = prepared_path(source, dtype, decode_weights, quantization, dense_prefill)
    # A truncated or corrupt checkpoint fails here, naming its file, before the model's memory is
    # allocated (a start from prepared weights never reads the GGUF, nor imports gguf).
    if prepared is None or not prepared.is_file():
        checkpoint.check()
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, max_positions)
        finally:
            torch.set_default_dtype(prev)
    codes = plan.apply(model, checkpoint.plan_input()) if plan is not None else {}
    if prepared is not None:
        from octavo.model.loader.prepared_cache import load_prepared
        if load_prepared(model, prepared):
            return _finish(model, source, device, quantization, pack_gemm, quantized_activations)
    model.load_weights(checkpoint.tensors(codes, plan))
    if plan is not None:
        plan.finish_lm_head(model, checkpoint.bits, checkpoint.table)
    if prepared is not None:
        from octavo.model.loader.prepared_cache import save_prepared
        save_prepared(model, prepared)
    return _finish(model, source, device, quantization, pack_gemm, quantized_activations)


def _finish(model: nn.Module, source: ModelSource, device: torch.device,
            quantization: str | None, pack_gemm: bool, quantized_activations: bool) -> nn.Module:
    """On the CPU dense bf16 experts become Linears of their own, and, with `pack_gemm`, dense
    bf16 weights of linear layers and the LM head are packed for oneDNN's GEMM (gemm_packing).
    The log states what the weights take."""
    if device.type == "cpu" and quantized_activations:
        from octavo.model.quant.weights import allow_quantized_activations
        allow_quantized_activations(model)
    if device.type == "cpu":
        from octavo.model.loader.gemm_packing import pack_now, split_experts
        split_experts(model)
        if pack_gemm:
            pack_now(model, quantization)
    from octavo.model.loader.weights_plan import log_weights_plan
    log_weights_plan(model, source.path.stat().st_size if source.is_gguf else None)
    return model.eval()
