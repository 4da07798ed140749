"""Build a model and stream its checkpoint tensors (safetensors or GGUF) into it."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.model.registry import model_class
from octavo.model_source import ModelSource


def load_model(source: ModelSource, cfg: ArchConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int) -> nn.Module:
    cls = model_class(cfg.architecture)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, max_positions)
        finally:
            torch.set_default_dtype(prev)
    if source.is_gguf:
        from octavo.model.loader.gguf_weights import iterate_gguf_weights
        weights = iterate_gguf_weights(source.path, cfg)
    else:
        from octavo.model.loader.safetensors_weights import iterate_safetensors_weights
        weights = iterate_safetensors_weights(source.path)
    model.load_weights(weights)
    return model.eval()
