"""The forward context: attention metadata for the current step, scoped by a context manager.

It lets a model keep the familiar `forward(input_ids, positions)` signature while its attention
layers find the step's plan and their KV cache.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from octavo.kernels import fused
from octavo.kernels.attention_backend import CPU_ATTN, AttentionBackend
from octavo.kernels.context_parallel import (
    ContextParallel,
    ContextParallelStep,
    build_step,
)
from octavo.kernels.paged_attention import (
    AttentionPlan,
    StepLayout,
    build_plan,
    chunked_plan,
    windowed_plan,
)

if TYPE_CHECKING:
    from octavo.model.layers.lora import LoRAStep


@dataclass
class ForwardContext:
    plan: AttentionPlan | None  # None under context parallelism
    kv_caches: list[torch.Tensor]  # one [2, num_blocks, block_size, kv_heads, head_dim] per layer
    sliding_plan: AttentionPlan | None = None  # for layers with a sliding window
    lora: LoRAStep | None = None  # which tokens run which adapter (none: the base model's)
    # this rank's share of the step under context parallelism (model/context_parallel.py)
    context_parallel: ContextParallelStep | None = None
    layout: StepLayout | None = None  # the step's requests (an encoder's sequences: bert.py)
    chunked_plan: AttentionPlan | None = None  # for layers with chunked local attention
    # each of the step's requests' batch row, where its recurrent state lives (linear
    # attention: model/layers/gated_delta_net.py), and the tokens it had computed before the
    # step (0: its state starts empty); None outside the runner's steps
    batch_rows: np.ndarray | None = None
    num_computed: np.ndarray | None = None
    # each request's draft tokens at the end of its span (speculative decoding; None: no
    # request has any): a recurrent state may not move past them before they are accepted
    num_drafts: np.ndarray | None = None
    # recurrent states saved during the step (prefix caching, core/state_checkpoints.py): [n, 3]
    # int64 rows of (request's index in the step, tokens into its step, checkpoint slot)
    state_saves: np.ndarray | None = None


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


def step_real_rows() -> int | None:
    """How many of this rank's rows are tokens where context parallelism split the step (the
    rest pad it to the rows every rank computes); None where it did not."""
    step = _current[-1].context_parallel if _current else None
    return step.own_end - step.own_start if step is not None and step.split else None


def step_lora() -> LoRAStep | None:
    """The step's adapter slots (None outside a forward pass, or with no adapter)."""
    return _current[-1].lora if _current else None


def step_context(layout: StepLayout, tables: np.ndarray, block_size: int,
                 kv_caches: list[torch.Tensor], sliding_window: int | None,
                 device: torch.device, cp: ContextParallel | None = None,
                 attention_chunk: int | None = None,
                 backend: AttentionBackend = CPU_ATTN) -> ForwardContext:
    """The context of one forward pass over the requests whose block tables are `tables`:
    the attention plan, and the sliding-window plan of a model with windowed layers (the same
    slots and kernel entries, the window applied), or the chunked plan of one with chunked
    local attention (`attention_chunk`). Whether the C++ kernel takes the short queries is
    the `backend`'s (kernels/attention_backend.py), asked per step: kernels built in the
    background take over once they are ready. Under context parallelism (`cp`), this rank's
    share of the step instead, whose attention applies each layer's own window; a step it does
    not split on a rank holding the whole cache is the single process's."""
    native = device.type == "cpu" and backend.kernel_takes_queries()
    if cp is not None and (cp.shard_kv or cp.splits(layout)):
        kernel = native and (cp.kv_ranks == 1 or sliding_window is None)
        return ForwardContext(None, kv_caches, context_parallel=build_step(
            cp, layout, tables, device, kernel), layout=layout)
    # (a layer of linear attention has an empty cache: the first attention layer's tells)
    runs = native and fused.prompt_runs_ready(next((c for c in kv_caches if c.numel()),
                                                   kv_caches[0]))
    plan = build_plan(layout, tables, block_size, device=device, native_decode=native,
                      prompt_runs=runs)
    sliding = None if sliding_window is None else windowed_plan(
        plan, layout, tables, block_size, sliding_window, device)
    chunked = None if attention_chunk is None else chunked_plan(
        plan, layout, tables, block_size, attention_chunk, device)
    return ForwardContext(plan, kv_caches, sliding, layout=layout, chunked_plan=chunked)
