"""Build a model and stream its checkpoint tensors (safetensors or GGUF) into it."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.registry import model_class
from octavo.model_source import ModelSource


def load_model(source: ModelSource, cfg: ArchConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int,
               decode_weights: str = "auto", quantization: str | None = None,
               pack_gemm: bool = True) -> nn.Module:
    """Build the model and fill it. A GGUF's linear layers keep packed int4/int8 weights made
    from its codes (model/quant/gguf.py): beside the dense ones for small (decode) batches with
    decode_weights="auto" in bf16, alone with `quantization` int4 or int8. A GGUF's prepared
    weights are cached on disk (see prepared_cache) for the next start. A quantized checkpoint
    (config.json's quantization_config) or `quantization` (int8, int4, fp8: quantize at load)
    hands linear layers their quant methods before the tensors stream in (see model/quant).
    On the CPU, dense bf16 weights are packed for oneDNN's GEMM unless `pack_gemm` is False: the
    caller then packs them itself, e.g. step by step (gemm_packing.StepwisePacking)."""
    from octavo.model.quant.config import plan_quantization
    plan = plan_quantization(source, quantization, dtype, decode_weights)
    if plan is not None and device.type != "cpu":
        if quantization is None and source.is_gguf:
            plan = None  # the decode copies are a CPU matter: dense weights elsewhere
        else:
            raise NotImplementedError(f"quantized weights ({plan.fmt}) run on the CPU only; "
                                      f"device={device.type}")
    cls = model_class(cfg.architecture)
    prepared = None
    if source.is_gguf and device.type == "cpu":
        from octavo.model.loader.prepared_cache import prepared_path
        prepared = prepared_path(source, dtype, decode_weights, quantization)
    # A truncated or corrupt checkpoint fails here, naming its file, before the model's memory is
    # allocated (a start from prepared weights never reads the GGUF, nor imports gguf).
    names: list[str] = []
    if not source.is_gguf:
        from octavo.model.loader.safetensors_weights import safetensors_names
        names = safetensors_names(source.path)  # safetensors checks each header and range
    elif prepared is None or not prepared.is_file():
        from octavo.model_files import check_gguf
        check_gguf(source.path)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, max_positions)
        finally:
            torch.set_default_dtype(prev)
    codes: set[str] = set()
    if source.is_gguf and plan is not None:
        from octavo.model.loader.gguf_weights import gguf_tensor_types
        codes = plan.apply(model, gguf_tensor_types(source.path, cfg))
    if prepared is not None:
        from octavo.model.loader.prepared_cache import load_prepared
        if load_prepared(model, prepared):
            return _finish(model, plan, device, quantization, pack_gemm)
    bits: dict[str, int] = {}
    if source.is_gguf:
        from octavo.model.loader.gguf_weights import iterate_gguf_weights
        weights = iterate_gguf_weights(source.path, cfg, bits, codes,
                                       dense_too=plan is None or plan.keep_dense)
    else:
        from octavo.model.loader.safetensors_weights import iterate_safetensors_weights
        if plan is not None:
            plan.apply(model, names)
        weights = iterate_safetensors_weights(source.path)
    model.load_weights(weights)
    packed_only = getattr(plan, "keep_dense", True) is False  # a GGUF with int4|int8
    if (decode_weights == "auto" or packed_only) and bits:
        _set_decode_bits(model, bits)
    if prepared is not None:
        from octavo.model.loader.prepared_cache import save_prepared
        save_prepared(model, prepared)
    return _finish(model, plan, device, quantization, pack_gemm)


def _finish(model: nn.Module, plan, device: torch.device, quantization: str | None,
            pack_gemm: bool) -> nn.Module:
    """With a GGUF's packed weights only (--quantization int4|int8, whatever decode_weights
    says), an untied LM head keeps its packed copy alone too (after the prepared weights were
    saved with it dense, as the model is built). On the CPU, with `pack_gemm`, dense bf16
    weights of linear layers and the LM head are then packed for oneDNN's GEMM (gemm_packing)."""
    head = getattr(model, "lm_head", None)
    if getattr(plan, "keep_dense", True) is False and hasattr(head, "packed_only"):
        head.packed_only()
    if device.type == "cpu" and pack_gemm:
        from octavo.model.loader.gemm_packing import pack_now
        pack_now(model, quantization)
    return model.eval()


def _set_decode_bits(model: nn.Module, bits: dict[str, int]) -> None:
    """The LM head's low-bit copy (linear layers get theirs from quant/gguf.py)."""
    per_module: dict[str, int] = {}
    for ckpt_name, b in bits.items():
        module = model.linear_name(ckpt_name)  # the module it fills (GPT-2: transformer.h...)
        if module is None:
            continue
        per_module[module] = max(per_module.get(module, 0), b)  # the widest shard decides
    modules = dict(model.named_modules())
    head = modules.get("lm_head")
    if head is not None and "lm_head" not in per_module:  # a tied head: its embedding's width
        per_module.update({"lm_head": b for name, b in per_module.items()
                           if getattr(modules.get(name), "weight", None) is head.weight})
    for name, module in modules.items():
        if hasattr(module, "set_decode_bits") and name in per_module:
            module.set_decode_bits(per_module[name])
