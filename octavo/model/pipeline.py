"""Pipeline parallelism in the model: each stage builds and runs a contiguous range of the decoder
layers, receives the hidden states of the stage before it and sends its own to the next.

A stage's KV caches are its own layers' only, so each attention layer's cache index is its place in
the stage (`stage_layers`), while the layer keeps its global index for everything the checkpoint
and the architecture say about it (names, sliding windows). Checkpoint tensors of other stages'
layers are skipped as they stream in (`local_layer_name`).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from octavo.distributed import parallel_state
from octavo.model.layers.attention import PagedAttention

_LAYER_NAME = re.compile(r"(^|\.)(layers|h)\.(\d+)\.")


def stage_range(num_layers: int) -> range:
    """This stage's layers: an even split, the earlier stages taking one more where it does not
    divide."""
    size, stage = parallel_state.pp_size(), parallel_state.pp_rank()
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def is_first_stage() -> bool:
    return parallel_state.pp_rank() == 0


def is_last_stage() -> bool:
    return parallel_state.pp_rank() == parallel_state.pp_size() - 1


def stage_layers(num_layers: int, make: Callable[[int], nn.Module]) -> nn.ModuleList:
    """This stage's decoder layers, `make(global index)` each, with their attention reading the
    stage's KV caches by their place in it."""
    layers = nn.ModuleList()
    for local, index in enumerate(stage_range(num_layers)):
        layer = make(index)
        for module in layer.modules():
            if isinstance(module, PagedAttention):
                module.layer_index = local
        layers.append(layer)
    return layers


def local_layer_name(name: str, num_layers: int) -> str | None:
    """A checkpoint name with its layer index made the stage's (None: another stage's layer)."""
    if parallel_state.pp_size() == 1:
        return name
    m = _LAYER_NAME.search(name)
    if m is None:
        return name
    layers = stage_range(num_layers)
    index = int(m[3])
    if index not in layers:
        return None
    return f"{name[:m.start(3)]}{index - layers.start}{name[m.end(3):]}"


def run_stage(inner: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
              hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`inner(input_ids, positions, hidden)` on this stage: the hidden states of the stage before
    it come in (none on the first), its own go out to the next (the last returns the normed
    states the LM head reads)."""
    if parallel_state.pp_size() == 1:
        return inner(input_ids, positions, None)
    hidden = None
    if not is_first_stage():
        hidden = torch.empty(input_ids.shape[0], hidden_size, dtype=dtype,
                             device=input_ids.device)
        parallel_state.pp_recv(hidden, parallel_state.pp_rank() - 1)
    out = inner(input_ids, positions, hidden)
    if not is_last_stage():
        parallel_state.pp_send(out, parallel_state.pp_rank() + 1)
    return out
