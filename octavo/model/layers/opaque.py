"""Modules a compiled graph calls whole: attention and linear attention read the step from the
forward context (plans, block tables, batch rows, saved states), which changes every step;
routed experts route rows by data; a linear layer picks its kernel by the step's rows and its
weights' kind, and its adapters by the step. Traced, each would make graphs (and guards) per
case, and inductor's handling of attention's in-place cache writes gave wrong tokens (stop 41).
They run instead as one opaque op, `octavo::opaque_module`, which looks the module up by name
and calls its eager forward: the graph holds a call and nothing of the step (vLLM's attention
and quantized products are opaque the same way)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from torch import nn


class OpaqueModule(Protocol):
    """A module the compiled graph calls as a whole: its eager forward over tensors, and an
    empty tensor of the shape and dtype that returns (for tracing, without running it)."""

    def eager_forward(self, *inputs: torch.Tensor) -> torch.Tensor: ...

    def empty_output(self, *inputs: torch.Tensor) -> torch.Tensor: ...


# The opaque modules of the layer whose graph is running (compiled.py enters them around each
# call), by the name the graph calls them by: their path in the layer, the same in every layer
# of a kind and every instance of the model, so one graph (and its library on disk) serves
# them all.
_running: list[Mapping[str, nn.Module]] = []


@contextlib.contextmanager
def modules_of(modules: Mapping[str, nn.Module]) -> Iterator[None]:
    _running.append(modules)
    try:
        yield
    finally:
        _running.pop()


def _opaque_module(inputs: list[torch.Tensor], name: str) -> torch.Tensor:
    return _running[-1][name].eager_forward(*inputs)


def _opaque_module_fake(inputs: list[torch.Tensor], name: str) -> torch.Tensor:
    return _running[-1][name].empty_output(*inputs)


# Defined on torch's library directly rather than by torch.library.custom_op, whose Python
# wrapper costs about 8 us a call more (a compiled layer makes five or more such calls).
_ops = torch.library.Library("octavo", "FRAGMENT")
_ops.define("opaque_module(Tensor[] inputs, str name) -> Tensor")
_ops.impl("opaque_module", _opaque_module, "CompositeExplicitAutograd")
torch.library.register_fake("octavo::opaque_module", _opaque_module_fake)


def call_opaque(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """module's forward: itself where nothing is being traced, else the opaque op's call."""
    if not torch.compiler.is_compiling():
        return module.eager_forward(*inputs)
    name = getattr(module, "opaque_name", None)
    if name is None:
        raise RuntimeError(f"{type(module).__name__} is traced (torch.export, torch.compile) "
                           "without having been named by octavo.model.compiled.compile_layers")
    return torch.ops.octavo.opaque_module(list(inputs), name)


def named(layer: nn.Module) -> dict[str, nn.Module]:
    """`layer`'s opaque modules by their paths in it, each told its name."""
    modules = {path: m for path, m in layer.named_modules() if hasattr(m, "eager_forward")}
    for path, module in modules.items():
        module.opaque_name = path
    return modules
