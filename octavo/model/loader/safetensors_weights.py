"""Tensors of a Hugging Face folder's safetensors files (sharded or not), memory-mapped."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_names(folder: Path) -> list[str]:
    """Every tensor name, read from the files' headers only."""
    names = []
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names
