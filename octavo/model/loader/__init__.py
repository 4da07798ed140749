"""Build a model and stream its checkpoint tensors (safetensors or GGUF) into it."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.registry import model_class
from octavo.model_source import ModelSource


def load_model(source: ModelSource, cfg: ArchConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int,
               decode_weights: str = "auto") -> nn.Module:
    """Build the model and fill it. With decode_weights="auto", linear layers whose GGUF source
    is 8-bit or narrower also keep a low-bit copy for small (decode) batches. A GGUF's prepared
    weights are cached on disk (see prepared_cache) for the next start."""
    cls = model_class(cfg.architecture)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, max_positions)
        finally:
            torch.set_default_dtype(prev)
    prepared = None
    if source.is_gguf and device.type == "cpu":
        from octavo.model.loader.prepared_cache import load_prepared, prepared_path
        prepared = prepared_path(source, dtype, decode_weights)
        if load_prepared(model, prepared):
            return model.eval()
    bits: dict[str, int] = {}
    if source.is_gguf:
        from octavo.model.loader.gguf_weights import iterate_gguf_weights
        weights = iterate_gguf_weights(source.path, cfg, bits)
    else:
        from octavo.model.loader.safetensors_weights import iterate_safetensors_weights
        weights = iterate_safetensors_weights(source.path)
    model.load_weights(weights)
    if decode_weights == "auto" and bits:
        _set_decode_bits(model, cfg, bits)
    if prepared is not None:
        from octavo.model.loader.prepared_cache import save_prepared
        save_prepared(model, prepared)
    return model.eval()


def _set_decode_bits(model: nn.Module, cfg: ArchConfig, bits: dict[str, int]) -> None:
    packed = getattr(model, "packed_modules_mapping", {})
    per_module: dict[str, int] = {}
    for name, b in bits.items():
        module = name.rpartition(".")[0]
        owner, _, leaf = module.rpartition(".")
        if leaf in packed:
            module = f"{owner}.{packed[leaf][0]}"
        per_module[module] = max(per_module.get(module, 0), b)  # the widest shard decides
    if cfg.tie_word_embeddings and "model.embed_tokens" in per_module:
        per_module["lm_head"] = per_module["model.embed_tokens"]
    for name, module in model.named_modules():
        if hasattr(module, "set_decode_bits") and name in per_module:
            module.set_decode_bits(per_module[name])
