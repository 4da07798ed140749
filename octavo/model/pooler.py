"""Pooling: each request's hidden states into one vector, as sentence-transformers' Pooling module
computes it (the mean of its tokens, its first token, [CLS], or its last) and its Normalize module
(unit length), with a request's `dimensions` kept first (Matryoshka models). A pooling request's
prompt is whole in the step that pools it (the scheduler sees to that), so its rows are
[start, end) of the step's flat hidden states."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

POOLING_KINDS = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, starts: np.ndarray, ends: np.ndarray, kind: str) -> torch.Tensor:
    """hidden [T, H]; the sequences' rows [starts[i], ends[i]) -> [len(starts), H] float32."""
    if kind == "cls":
        return hidden.index_select(0, torch.from_numpy(starts).to(hidden.device)).float()
    if kind == "last":
        return hidden.index_select(0, torch.from_numpy(ends - 1).to(hidden.device)).float()
    if kind != "mean":
        raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got {kind!r}")
    lengths = ends - starts
    which = np.repeat(np.arange(len(starts)), lengths)  # each pooled row's sequence
    offsets = np.cumsum(lengths) - lengths  # where each sequence's rows start among them
    rows = starts[which] + np.arange(len(which)) - offsets[which]
    device = hidden.device
    sums = torch.zeros((len(starts), hidden.shape[1]), dtype=torch.float32, device=device)
    sums.index_add_(0, torch.from_numpy(which).to(device),
                    hidden.index_select(0, torch.from_numpy(rows).to(device)).float())
    return sums / torch.from_numpy(lengths).to(device, torch.float32).unsqueeze(1)


def finish(vectors: torch.Tensor, dimensions: list[int | None],
           normalize: list[bool]) -> list[np.ndarray]:
    """Each pooled row cut to its request's dimensions (None: all) and, where asked, scaled to
    unit length."""
    out = []
    for row, dims, unit in zip(vectors, dimensions, normalize):
        if dims is not None:
            row = row[:dims]
        if unit:
            row = F.normalize(row, dim=0)
        out.append(row.cpu().numpy())
    return out
