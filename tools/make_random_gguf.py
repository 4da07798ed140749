"""Write a Llama-shaped GGUF of random Q4_0 weights, for memory and speed checks at sizes no real
model here has (7B-class: `--hidden 4096 --layers 32 --intermediate 11008 --heads 32`).

The weights are random codes with a scale that gives them a trained model's spread, so the model
loads, runs and decodes at full cost, and its text is noise. The tokenizer and its metadata are
SmolLM2's (a real GGUF's, copied key by key), so the file starts like any catalog model.
Usage: python tools/make_random_gguf.py OUT.gguf [--hidden ...] (about 3.9 GB for 7B shapes).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import numpy as np

from octavo.model_files import open_gguf

_TOKENIZER_FROM = Path.home() / ".cache/octavo/models/smollm2-135m-instruct-q4_1.gguf"


def _q4_0(rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random Q4_0 blocks [rows, cols / 32 * 18]: a float16 scale, then 16 bytes of codes."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 18), dtype=np.uint8)
    scale = np.full(blocks, std / 4.6, dtype=np.float16)  # codes - 8 have a std of about 4.6
    out[:, :2] = scale.view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return out.reshape(rows, cols // 32 * 18)


def _copy_tokenizer(w: gguf.GGUFWriter, source: Path) -> int:
    """SmolLM2's tokenizer keys; returns its vocabulary size."""
    meta = open_gguf(source).metadata
    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    return len(meta["tokenizer.ggml.tokens"])


def write(path: Path, hidden: int, layers: int, intermediate: int, heads: int,
          kv_heads: int, context: int = 4096, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")  # whole or not at all
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random-llama-{layers}x{hidden}")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    vocab = _copy_tokenizer(w, _TOKENIZER_FROM)
    head_dim = hidden // heads
    q4 = gguf.GGMLQuantizationType.Q4_0

    def add(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, _q4_0(rows, cols, rng), raw_shape=(rows, cols // 32 * 18),
                     raw_dtype=q4)

    ones = np.ones(hidden, dtype=np.float32)
    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        add(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        add(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", vocab, hidden)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    a = p.parse_args()
    write(a.out, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads)


if __name__ == "__main__":
    main()
