"""Tensors of a GGUF file, dequantized and renamed to the Hugging Face layout."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from octavo.arch_config import ArchConfig

_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma puts a norm before and after each sublayer; GGUF names the one before the MLP ffn_norm.
_LAYER_BY_ARCH = {
    "gemma2": {**_LAYER, "ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {**_LAYER, "ffn_norm": "pre_feedforward_layernorm"},
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

# Architectures whose converter permuted q/k rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK = {"llama", "mistral"}
# Architectures whose RMSNorm scales by (1 + w): llama.cpp's converter stores 1 + w.
_NORM_PLUS_ONE = {"gemma2", "gemma3"}


def hf_name(gguf_name: str, arch: str | None = None) -> str:
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = _LAYER_BY_ARCH.get(arch, _LAYER)
        if part not in names:
            raise ValueError(f"GGUF tensor {gguf_name} has no known Hugging Face name")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL:
        raise ValueError(f"GGUF tensor {gguf_name} has no known Hugging Face name")
    return f"{_GLOBAL[stem]}.{kind}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the converter's row permutation (interleaved pairs -> rotate-half halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_bits(tensor_type: GGMLQuantizationType) -> int:
    """Bits per weight of a GGML type, before its block scales (Q4_1 -> 4, Q8_0 -> 8, F16 -> 16)."""
    m = re.search(r"Q(\d)", tensor_type.name)
    if m:
        return int(m.group(1))
    return 32 if tensor_type.name == "F32" else 16


def iterate_gguf_weights(path: Path, cfg: ArchConfig,
                         bits: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, dequantized tensor); `bits` gets each tensor's source width."""
    reader = GGUFReader(path)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise NotImplementedError("GGUF rope_freqs (llama3 rope scaling) is not supported yet")
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = np.array(t.data).reshape(shape)  # a copy: the mmap is read-only
        else:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
        name = hf_name(t.name, cfg.gguf_arch)
        if cfg.gguf_arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1
        if bits is not None:
            bits[name] = source_bits(t.tensor_type)
        if cfg.gguf_arch in _PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if "attn_q" in t.name else cfg.num_kv_heads
            w = _unpermute(w, heads)
        yield name, torch.from_numpy(w)
