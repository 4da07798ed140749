"""torch.compile of a model's decoder layers (`--compilation-level` 1-3; vLLM's
`compilation_config`): the steps that would run the layers one by one from Python (every step
under `--enforce-eager`; otherwise the few the decode stack does not take) run each layer as an
inductor graph, one per kind of layer.

What the compiler sees: everything in a layer but its attention, linear attention and routed
experts, which run as opaque ops (model/layers/opaque.py), named by their path in the layer.

Graphs are cached on disk by inductor under `$OCTAVO_CACHE/compile` (its FX-graph and
AOT-autograd caches), so a second start reuses the first one's compiled code; tracing the
layer again is what a start still pays.
"""
from __future__ import annotations

import itertools
import logging
import os
import types

import torch
from torch import nn

from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layers import opaque

logger = logging.getLogger(__name__)

_model_numbers = itertools.count()


def _run_layer(layer: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return layer(positions, x)


def compile_layers(model: nn.Module, level: int, cache_dir: str) -> None:
    """Compile `model`'s decoder layers (a causal LM whose inner model has `layers` and a
    `compiled_layers` slot, which run_layers then calls); graphs are made at the first steps."""
    inner = getattr(model, "model", None)  # level: 1-3, as DeviceConfig checked
    if inner is None or not hasattr(inner, "compiled_layers"):
        raise NotImplementedError(f"compilation_level {level}: {type(model).__name__} has no "
                                  "decoder layers octavo compiles")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    opaque_modules = {id(layer): opaque.named(layer) for layer in layers}
    # One graph per kind of layer, not one of the whole stack: a model's layers are few kinds
    # (Gemma's local and global ones, say) and tracing one costs a thirtieth of tracing
    # thirty, which every start pays again (inductor's cache keeps only the compiled code).
    # A function of its own (a new code object): torch keeps graphs per code object, and
    # another model's would count against this one's recompilation limit. A step's token
    # count is a dimension of the graph: one graph for every count above 1 (and one for
    # single tokens, which torch specializes), not one per count.
    number = next(_model_numbers)
    code = _run_layer.__code__.replace(co_name=f"run_layer_{number}")
    graph = torch.compile(types.FunctionType(code, _run_layer.__globals__), dynamic=True)
    for layer in layers:
        layer.described()  # before tracing: made during it, it would be a second graph
    # Never more graphs than two per layer: past torch's limit it would run them eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               2 * len(layers))

    def run(stack: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in stack:
            with opaque.modules_of(opaque_modules[id(layer)]):
                x = graph(layer, positions, x)
        return x

    inner.compiled_layers = run
    logger.info("compilation level %d: the decoder layers' Python steps run as inductor graphs "
                "(cached in %s)", level, os.environ["TORCHINDUCTOR_CACHE_DIR"])
