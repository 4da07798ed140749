"""The independent oracle: Hugging Face transformers on the same weights.

transformers dequantizes a GGUF file slowly, so each catalog model is converted once into a
Hugging Face folder (float32 safetensors + tokenizer) under the octavo cache and loaded from there.
"""
from __future__ import annotations

import contextlib
import fcntl
import shutil
from pathlib import Path

from octavo.model_source import cache_dir, pull


def oracle_folder(catalog_name: str) -> Path:
    """A Hugging Face folder holding the dequantized weights of catalog model `catalog_name`."""
    out = cache_dir() / "oracle" / catalog_name
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{catalog_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "model.safetensors").is_file():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = pull(catalog_name)
        with one_metadata_parse():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The model is plain float32 now; drop the GGUF marker that blocks save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = out.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


@contextlib.contextmanager
def one_metadata_parse():
    """transformers opens the GGUF three times (config, weights, tokenizer), and gguf-py's parse
    of the metadata (the vocabulary, one string at a time) is most of a conversion's time: one
    reader per file serves all three."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
