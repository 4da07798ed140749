"""The forward context: attention metadata for the current step, scoped by a context manager.

It lets a model keep the familiar `forward(input_ids, positions)` signature while its attention
layers find the step's plan and their KV cache.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from octavo.kernels.paged_attention import AttentionPlan


@dataclass
class ForwardContext:
    plan: AttentionPlan
    kv_caches: list[torch.Tensor]  # one [2, num_blocks, block_size, kv_heads, head_dim] per layer
    sliding_plan: AttentionPlan | None = None  # for layers with a sliding window


_current: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    _current.append(ctx)
    try:
        yield
    finally:
        _current.pop()


def get_forward_context() -> ForwardContext:
    if not _current:
        raise RuntimeError("attention ran outside a forward_context")
    return _current[-1]
