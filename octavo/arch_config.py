"""A model's architecture, normalized from a Hugging Face config.json or GGUF metadata.

Torch-free: the front end reads it for the context length, the worker for building the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from octavo.model_source import ModelSource

# GGUF `general.architecture` -> the Hugging Face architecture name octavo registers it under.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()  # from generation_config.json, when it names several
    sliding_window: int | None = None  # every layer attends to at most this many latest tokens
    gguf_arch: str | None = None  # set for GGUF files: their tensor layout differs


def read_arch_config(source: ModelSource) -> ArchConfig:
    return _from_gguf(source) if source.is_gguf else _from_hf(source)


def _from_hf(source: ModelSource) -> ArchConfig:
    cfg = json.loads((source.path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"model: {source.path}/config.json names no architectures")
    text = cfg.get("text_config", cfg)
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    eos: tuple[int, ...] = ()
    gen_path = source.path / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            eos = tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
    rope_theta = text.get("rope_theta")
    rope_scaling = text.get("rope_scaling")
    params = text.get("rope_parameters")  # transformers >= 5 folds theta and scaling here
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    return ArchConfig(
        architecture=archs[0],
        vocab_size=text["vocab_size"],
        hidden_size=hidden,
        intermediate_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads,
        max_position_embeddings=text.get("max_position_embeddings", 2048),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta or 10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        attention_bias=text.get("attention_bias", archs[0].startswith("Qwen2")),
        hidden_act=text.get("hidden_act", text.get("hidden_activation", "silu")),
        eos_token_ids=eos,
        # Qwen2 configs name a window they do not use unless use_sliding_window is set.
        sliding_window=text.get("sliding_window") if text.get("use_sliding_window", True) else None,
    )


def _from_gguf(source: ModelSource) -> ArchConfig:
    from gguf import GGUFReader

    reader = GGUFReader(source.path)
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.") or k.endswith("_id")}
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported yet; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}")
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hidden = meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    names = {t.name for t in reader.tensors}
    scaling = None
    if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] != "none":
        scaling = {"rope_type": meta[f"{arch}.rope.scaling.type"],
                   "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0),
                   "original_max_position_embeddings":
                       meta.get(f"{arch}.rope.scaling.original_context_length")}
    return ArchConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        gguf_arch=arch,
    )
