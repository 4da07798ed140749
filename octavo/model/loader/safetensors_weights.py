"""Tensors of a Hugging Face folder's safetensors files (sharded or not), memory-mapped.

safetensors checks a file before it maps it (the header length against the file, the header's
JSON, each tensor's dtype, shape and byte range), so a truncated or corrupt file fails at once;
its error only lacks the file's name, which `_open` adds.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{file}: not a valid safetensors file: {exc}") from None
    with handle as f:
        yield f


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {folder} has no .safetensors files (pickle checkpoints are "
                         "never loaded)")
    return files


def iterate_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with _open(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_names(folder: Path) -> list[str]:
    """Every tensor name, read from the files' headers only."""
    names = []
    for file in safetensors_files(folder):
        with _open(file) as f:
            names.extend(f.keys())
    return names
