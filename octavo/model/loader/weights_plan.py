"""What a loaded model's weights take, by kind: the start-up log's statement of the plan (dense
weights, packed int4 / int8 weights alone, low-bit copies beside dense ones, everything else),
each tensor counted once however many modules share it (a tied LM head and its embedding)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.quant.weights import DenseWeights, PackedWeights, packed_kind

logger = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor) -> tuple[int, int]:
    """(a key for the memory, its bytes)"""
    if t.is_mkldnn:  # a oneDNN-packed weight: opaque, no storage to share
        return id(t), t.numel() * t.element_size()
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes per kind: "dense", "int4" / "int8" / "int8g" (packed, alone), "<kind> copies"
    (beside dense weights, for small batches) and "other" (norms, biases, experts' tensors).
    Rotary tables are not weights (rotary_table_bytes)."""
    seen: set[int] = {_nbytes(t)[0] for t in _rotary_tables(model)}
    out: dict[str, int] = {}

    def add(kind: str, t: torch.Tensor) -> None:
        key, n = _nbytes(t)
        if key not in seen:
            seen.add(key)
            out[kind] = out.get(kind, 0) + n

    for module in model.modules():
        weights = getattr(module, "weights", None)
        if isinstance(weights, DenseWeights):
            add("dense", weights.weight)
            if weights.small_batch is not None:
                for t in weights.small_batch.tensors().values():
                    add(f"{packed_kind(weights.small_batch)} copies", t)
        elif isinstance(weights, PackedWeights):
            for t in weights.packed.tensors().values():
                add(packed_kind(weights.packed), t)
    for p in model.parameters():
        add("other", p)
    for b in model.buffers():
        add("other", b)
    return out


def _rotary_tables(model: nn.Module) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, RotaryEmbedding) for t in (m.cos, m.sin)]


def rotary_table_bytes(model: nn.Module) -> int:
    """The rotary embeddings' cos/sin tables: float32 for every position up to the context
    length, so sized by --max-model-len as the KV cache is (Gemma 3's two, 32k positions of 256
    features: 64 MB)."""
    return sum(size for _, size in {_nbytes(t) for t in _rotary_tables(model)})


def log_weights_plan(model: nn.Module, file_bytes: int | None) -> None:
    by_kind = weight_bytes(model)
    total = sum(by_kind.values())
    parts = ", ".join(f"{kind} {n / 2**20:.1f} MB" for kind, n in sorted(by_kind.items()))
    against = f" ({total / file_bytes:.2f}x the checkpoint file)" if file_bytes else ""
    tables = rotary_table_bytes(model)
    beside = f"; rotary tables {tables / 2**20:.1f} MB (sized by the context length)" \
        if tables else ""
    logger.info("weights: %.1f MB%s: %s%s", total / 2**20, against, parts, beside)
