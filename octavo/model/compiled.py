"""torch.compile of a model's decoder layers (`--compilation-level` 1-3; vLLM's
`compilation_config`): the steps that would run the layers one by one from Python (every step
under `--enforce-eager`; otherwise the few the decode stack does not take) run each layer as an
inductor graph, one per kind of layer.

What the compiler sees: everything in a layer but its attention, linear attention, routed
experts and linear layers, which run as opaque ops (model/layers/opaque.py), named by their path
in the layer: the norms, rotary embeddings, activations and residual sums between them.

Graphs are cached on disk by inductor under `$OCTAVO_CACHE/compile/<hash of octavo's model and
kernel code>` (its FX-graph and AOT-autograd caches), so a second start reuses the first one's
compiled code; tracing the layer again is what a start still pays.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import types
from pathlib import Path

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layers import opaque

logger = logging.getLogger(__name__)

_model_numbers = itertools.count()
# The layers' code and the kernels' fakes (octavo/model, octavo/kernels).
_TRACED_CODE = [Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "kernels"]


def _run_layer(layer: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return layer(positions, x)


def _code_key() -> str:
    """A hash of the Python the graphs are traced from. Inductor's cache keys a graph by its
    own code, not by what its opaque ops' fakes said their outputs are: a graph cached before
    such a change would be reused after it (a wrong output dtype there corrupted memory)."""
    digest = hashlib.sha256()
    for package in _TRACED_CODE:
        for path in sorted(package.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _start_compiler() -> None:
    """What inductor does once a process before its first graph, made cheaper: on a warm cache
    these were 2 s of a start's 4.6 s in the first step (SmolLM2, AMD EPYC Zen 4)."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    # Inductor builds a test library for each vector ISA the CPU's flags name and loads it in a
    # child process (1.5 s a start); octavo's own kernels were built for this CPU by the same
    # compiler, so the flags are taken as they stand.
    inductor_config.cpp.vec_isa_ok = True
    # The cache keys hash torch's and triton's sources (0.6 s): hashed in the background while
    # the rest of the engine starts.
    codecache.torch_key.prefetch()
    codecache.triton_key.prefetch()


class _Zeros:
    """Stands in for an opaque module while the graphs are traced at load: the output it would
    make, zeroed, without a step to read (there is none) or caches and states to touch."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def empty_output(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module.empty_output(*inputs)

    def eager_forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module.empty_output(*inputs).zero_()


def compile_layers(model: nn.Module, level: int, cache_dir: str, hidden_size: int,
                   dtype: torch.dtype, device: torch.device) -> None:
    """Compile `model`'s decoder layers (a causal LM whose inner model has `layers` and a
    `compiled_layers` slot, which run_layers then calls). The graphs are made now, over
    activations of `hidden_size` and `dtype` on `device`, so that the first requests do not
    wait for them."""
    inner = getattr(model, "model", None)  # level: 1-3, as DeviceConfig checked
    if inner is None or not hasattr(inner, "compiled_layers"):
        raise NotImplementedError(f"compilation_level {level}: {type(model).__name__} has no "
                                  "decoder layers octavo compiles")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, _code_key()))
    _start_compiler()
    from torch._inductor import config as inductor_config  # not imported by an eager start

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

    def run(stack: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor,
            modules: dict[int, dict[str, nn.Module]] = opaque_modules) -> torch.Tensor:
        # Sizes that happen to be equal are not one symbol ("duck shapes"): a first step of as
        # many tokens as the hidden size would tie the token count to it, and every other
        # count would then need a graph of its own. A layer's floats (norms' epsilons, scales)
        # are constants of its graph: left to torch, the first model of a process took them as
        # inputs and the next ones as constants, two graphs where the cache should give one.
        # Fused kernels round where the eager ops round (bf16 after each op): the graphs give
        # the eager layers' outputs exactly, in every dtype.
        with fx_config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(specialize_float=True), \
                inductor_config.patch(emulate_precision_casts=True):
            for layer in stack:
                with opaque.modules_of(modules[id(layer)]):
                    x = graph(layer, positions, x)
        return x

    # Every layer over steps of two tokens and of one, its opaque modules giving zeros: the
    # graphs real steps take (the same guards: grad mode, dtypes, layouts), made before any.
    stand_ins = {key: {name: _Zeros(m) for name, m in named.items()}
                 for key, named in opaque_modules.items()}
    with torch.inference_mode():
        for tokens in (2, 1):
            run(layers, torch.zeros(tokens, dtype=torch.long, device=device),
                torch.zeros(tokens, hidden_size, dtype=dtype, device=device), stand_ins)
    inner.compiled_layers = run
    logger.info("compilation level %d: the decoder layers' Python steps run as inductor graphs "
                "(cached in %s)", level, os.environ["TORCHINDUCTOR_CACHE_DIR"])
