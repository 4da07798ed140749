"""Tensors of a Hugging Face folder's safetensors files (sharded or not), memory-mapped.

safetensors checks a file before it maps it (the header length against the file, the header's
JSON, each tensor's dtype, shape and byte range), so a truncated or corrupt file fails at once;
its error only lacks the file's name, which `_open` adds.

Matrices come as lazy tensors (lazy_tensor.py) over safetensors' slices, which read only the
rows and columns asked for: a tensor-parallel rank reads its share, never the whole tensor.
Vectors and scalars (norms, biases, scales) are read whole.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from octavo.model.loader.lazy_tensor import lazy, note_read


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


class _SliceReader:
    """One tensor of a safetensors file, its leading dimensions flattened into rows."""

    def __init__(self, name: str, part, shape: list[int]) -> None:
        self.name, self._part, self._lead = name, part, tuple(shape[:-1])
        self.rows, self.cols = int(np.prod(self._lead)), shape[-1]
        self.dtype = part[:0].dtype  # an empty read says the dtype

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        note_read(self.name, (r1 - r0) * (c1 - c0))
        inner = self._lead[-1]
        pieces = []
        while r0 < r1:  # within one index of the dimensions before the last leading one
            outer, first = divmod(r0, inner)
            stop = min(r1, r0 + inner - first)
            where = tuple(int(i) for i in np.unravel_index(outer, self._lead[:-1])) \
                if len(self._lead) > 1 else ()
            pieces.append(self._part[(*where, slice(first, first + stop - r0), slice(c0, c1))])
            r0 = stop
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def iterate_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor; matrices lazy (read where they are used)."""
    for file in safetensors_files(folder):
        with _open(file) as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape = part.get_shape()
                if len(shape) < 2:
                    yield name, f.get_tensor(name)
                else:
                    yield name, lazy(_SliceReader(name, part, shape), tuple(shape))


def safetensors_names(folder: Path) -> list[str]:
    """Every tensor name, read from the files' headers only."""
    names = []
    for file in safetensors_files(folder):
        with _open(file) as f:
            names.extend(f.keys())
    return names
