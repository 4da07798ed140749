"""Compiled decoder layers (`--compilation-level` 1-3; vLLM's `compilation_config`): the steps
that would run the layers one by one from Python (every step under `--enforce-eager`; otherwise
the few the decode stack does not take) run each layer as an AOTInductor graph instead, one
graph per kind of layer, for every token count.

What a graph holds: everything in a layer but its attention, linear attention, routed experts
and linear layers, which run as opaque ops (model/layers/opaque.py), named by their path in the
layer: the norms, rotary embeddings, activations and residual sums between them. The layer's
own tensors (norm weights, rotary tables) are the graph's inputs, so one graph serves every
layer of its kind.

How a graph is made (once per kind of layer and machine): `torch.export` traces the layer with
a dynamic token count, AOTInductor compiles it to a shared library packaged under
`$OCTAVO_CACHE/compile/<hash of octavo's model and kernel code>/<kind>.pt2`. A start loads the
packages through torch's C++ loader, without importing dynamo or inductor and without tracing
anything (torch.compile's caches keep only compiled code: a start still imported the compiler
and traced each kind of layer again); a graph's call runs no Python guards.

A kind of layer is what decides its graph: its modules' types and settings, its tensors'
shapes, and what its opaque modules take and return. Every layer is checked against its graph
at load (opaque modules answering with a function of their inputs): a layer its kind's graph
does not reproduce is an error, never a silently wrong step.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import itertools
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layers import opaque
from octavo.platform import cpu_platform

logger = logging.getLogger(__name__)

# The layers' code and the kernels' fakes (octavo/model, octavo/kernels).
_TRACED_CODE = [Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "kernels"]
_PROBE_TOKENS = (3, 1)  # the check's steps: several tokens, and the single token of decodes
_MAX_TOKENS = 1 << 20  # the graphs' bound on a step's token count
_PARTIAL = ".partial.pt2"  # a package being written (inductor wants the .pt2 suffix)
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _code_key() -> str:
    """A hash of the Python the graphs are traced from (a graph made before a change to it must
    not be loaded after)."""
    digest = hashlib.sha256()
    for package in _TRACED_CODE:
        for path in sorted(package.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _machine_key(device: torch.device) -> str:
    """What a compiled library depends on beyond the layer: torch, and the CPU's instructions
    (inductor compiles for this CPU's vector ISA) or the GPU."""
    if device.type == "cuda":
        target = torch.cuda.get_device_name(device)
    else:
        target = cpu_platform().key()
    return f"{torch.__version__} {device.type} {target}"


def _setting(value: Any) -> Any:
    """A module attribute as it enters the key of its layer's kind (None where it is state a
    graph does not see: tensors and caches made while running)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, enum.Enum):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v) for v in value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return None


def _own_tensors(layer: nn.Module, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers outside its opaque modules (which use their own): the
    graph's inputs, by their names in the layer."""
    def outside(name: str) -> bool:
        return not any(name.startswith(path + ".") for path in modules)
    named = itertools.chain(layer.named_parameters(), layer.named_buffers())
    return {name: t.detach() for name, t in named if outside(name)}


def _kind(layer: nn.Module, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor],
          calls: list[tuple], machine: str, dtype: torch.dtype) -> str:
    """The key of `layer`'s kind: what decides its graph."""
    parts: list[Any] = [machine, str(dtype)]
    for path, module in layer.named_modules():
        if any(path.startswith(p + ".") for p in modules):
            continue
        settings = () if path in modules else tuple(sorted(
            (k, _setting(v)) for k, v in vars(module).items() if not k.startswith("_")))
        parts.append((path, type(module).__module__, type(module).__qualname__, settings))
    parts.extend((name, tuple(t.shape), t.stride(), t.dtype) for name, t in tensors.items())
    parts.extend(calls)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _echo(module: nn.Module, name: str, calls: list[tuple], *inputs: torch.Tensor
          ) -> torch.Tensor:
    """An opaque module's answer while the layers are checked: its output's shape and dtype,
    filled with a function of all its inputs (so that a graph which computed any input
    differently answers differently), recorded in `calls`."""
    out = module.empty_output(*inputs)
    rows = out.shape[0]
    parts = [i.reshape(rows, -1).float() for i in inputs if i.dim() and i.shape[0] == rows]
    flat = out.view(rows, -1)
    width = flat.shape[1]
    source = torch.cat(parts, 1) if parts else flat.new_zeros(rows, 1, dtype=torch.float32)
    source = source.repeat(1, -(-width // source.shape[1]))[:, :width]
    flat.copy_(torch.sin(source + 0.37 * torch.arange(width, device=out.device)))
    calls.append((name, tuple((tuple(i.shape), i.dtype) for i in inputs), tuple(out.shape),
                  out.dtype))
    return out


@contextlib.contextmanager
def _echoing(modules: dict[str, nn.Module], calls: list[tuple]) -> Iterator[None]:
    for name, module in modules.items():
        module.eager_forward = functools.partial(_echo, module, name, calls)
    try:
        with opaque.modules_of(modules):
            yield
    finally:
        for module in modules.values():
            del module.eager_forward


class _Flat(nn.Module):
    """A layer as a function of its own tensors (a list) and the step's positions and
    activations: what is exported."""

    def __init__(self, layer: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.held = (layer,)  # in a tuple: not a submodule, whose tensors export would lift
        self.names = names

    def forward(self, tensors: list[torch.Tensor], positions: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.held[0], dict(zip(self.names, tensors)),
                                          (positions, x))


def _compile(layer: nn.Module, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor],
             probe: tuple[torch.Tensor, torch.Tensor], package: Path) -> None:
    """Export `layer` with a dynamic token count and compile it into `package` (written whole
    or not at all)."""
    from torch._inductor import config as inductor_config  # only where a graph is made
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=_MAX_TOKENS)
    names = list(tensors)
    # The opaque ops' outputs, while the layer is traced and while inductor compiles it.
    with opaque.modules_of(modules), torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(
            _Flat(layer, names), (list(tensors.values()), *probe),
            dynamic_shapes=([None] * len(names), {0: tokens}, {0: tokens}), strict=False)
    if program.constants:
        raise NotImplementedError(
            f"compilation_level: {type(layer).__name__} holds tensors that are neither "
            f"parameters nor buffers ({sorted(program.constants)}); a graph would keep one "
            "layer's values for all")
    handle, partial = tempfile.mkstemp(dir=package.parent, prefix=f"{package.stem}.",
                                       suffix=_PARTIAL)
    os.close(handle)
    try:
        # Fused kernels round where the eager ops round (bf16 after each op): the graphs give
        # the eager layers' outputs exactly, in every dtype. Their kernels run on one thread:
        # the layer's heavy work is in octavo's kernels and torch's ops, threaded by torch's
        # OpenMP pool, and inductor's code would start a second pool (the system's libgomp)
        # spinning beside it.
        with opaque.modules_of(modules), inductor_config.patch(
                {"emulate_precision_casts": True, "cpp.threads": 1}):
            torch._inductor.aoti_compile_and_package(program, package_path=partial)
        os.chmod(partial, 0o644)
        os.replace(partial, package)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


class _Graph:
    """One kind of layer's compiled graph, loaded."""

    def __init__(self, package: Path, device: torch.device) -> None:
        index = device.index if device.type == "cuda" and device.index is not None else -1
        # torch's C++ loader (what torch._inductor.aoti_load_package wraps): importing
        # torch._inductor would import dynamo, most of a compiled start's cost.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", True, 1,
                                                            index)

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.loader.run(inputs)[0]


def _graph(key: str, folder: Path, layer: nn.Module, modules: dict[str, nn.Module],
           tensors: dict[str, torch.Tensor], probe: tuple[torch.Tensor, torch.Tensor],
           device: torch.device) -> tuple[_Graph, bool]:
    """The graph of `key`'s kind, loaded from its package, made first where there is none (by
    one process at a time: tensor-parallel ranks make the same graphs)."""
    from torch.utils._filelock import FileLock

    package = folder / f"{key}.pt2"
    if package.exists():
        return _Graph(package, device), False
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / f"{key}.lock")):
        made = not package.exists()
        if made:
            # What a process killed while making this kind's graph left (the lock is ours).
            for stale in folder.glob(f"{key}.*{_PARTIAL}"):
                stale.unlink()
            logger.info("compilation level: making the graph of %s's kind of layer (once: "
                        "later starts load it)", type(layer).__name__)
            _compile(layer, modules, tensors, probe, package)
    return _Graph(package, device), made


def _probe(tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 64, (tokens,), generator=generator).to(device)
    x = torch.randn(tokens, hidden_size, generator=generator).to(dtype=dtype, device=device)
    return positions, x


def compile_layers(model: nn.Module, level: int, cache_dir: str, hidden_size: int,
                   dtype: torch.dtype, device: torch.device) -> None:
    """Run `model`'s decoder layers as compiled graphs (a causal LM whose inner model has
    `layers` and a `compiled_layers` slot, which run_layers then calls): loaded from
    `cache_dir`, or made there first. Each layer is checked against its graph now, over
    activations of `hidden_size` and `dtype` on `device`."""
    inner = getattr(model, "model", None)  # level: 1-3, as DeviceConfig checked
    if inner is None or not hasattr(inner, "compiled_layers"):
        raise NotImplementedError(f"compilation_level {level}: {type(model).__name__} has no "
                                  "decoder layers octavo compiles")
    start = time.perf_counter()
    # Inductor's own caches (its precompiled headers, kernels) beside the packages.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
    folder = Path(cache_dir) / _code_key()
    machine = _machine_key(device)
    probes = [_probe(tokens, hidden_size, dtype, device) for tokens in _PROBE_TOKENS]
    graphs: dict[str, _Graph] = {}
    made = 0
    runs: dict[int, tuple[_Graph, list[torch.Tensor], dict[str, nn.Module]]] = {}
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    with torch.inference_mode():
        for number, layer in enumerate(layers):
            layer.described()  # before tracing: made during it, it would be traced too
            modules = opaque.named(layer)
            tensors = _own_tensors(layer, modules)
            calls: list[tuple] = []
            with _echoing(modules, calls):
                expected = [layer(*probe) for probe in probes]
            key = _kind(layer, modules, tensors, calls, machine, dtype)
            if key not in graphs:
                graphs[key], fresh = _graph(key, folder, layer, modules, tensors, probes[0],
                                            device)
                made += fresh
            inputs = list(tensors.values())
            _check(number, layer, graphs[key], inputs, modules, probes, expected)
            runs[id(layer)] = graphs[key], inputs, modules

    inner.compiled_layers = CompiledLayers(runs, len(graphs), made)
    logger.info("compilation level %d: %d decoder layers run as %d AOTInductor graphs (%d made, "
                "the rest loaded from %s) in %.2f s", level, len(layers), len(graphs), made,
                folder, time.perf_counter() - start)


class CompiledLayers:
    """A model's decoder layers as their graphs (what run_layers calls)."""

    def __init__(self, runs: dict[int, tuple[_Graph, list[torch.Tensor], dict[str, nn.Module]]],
                 kinds: int, made: int) -> None:
        self.runs = runs  # by the layer's id: its graph, own tensors and opaque modules
        self.kinds = kinds  # graphs, one per kind of layer
        self.made = made  # of which made at this start (the rest loaded)

    def __call__(self, stack: nn.ModuleList, positions: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
        for layer in stack:
            graph, inputs, modules = self.runs[id(layer)]
            with opaque.modules_of(modules):
                x = graph([*inputs, positions, x])
        return x


def _check(number: int, layer: nn.Module, graph: _Graph, inputs: list[torch.Tensor],
           modules: dict[str, nn.Module], probes: list[tuple[torch.Tensor, torch.Tensor]],
           expected: list[torch.Tensor]) -> None:
    """`graph` gives `layer`'s eager outputs over the probes (bf16 exactly: the graphs round
    where the eager ops do; float32 up to the order of fused sums)."""
    tolerance = 1e-4 if expected[0].dtype == torch.float32 else 0.0
    for probe, want in zip(probes, expected):
        where = (f"compilation_level: decoder layer {number} ({type(layer).__name__}) over "
                 f"{probe[1].shape[0]} tokens")
        try:
            with _echoing(modules, []):
                got = graph([*inputs, *probe])
        except RuntimeError as error:
            raise RuntimeError(f"{where}: its kind's graph fails ({error}); the key of its "
                               "kind misses a setting") from error
        error = (got.float() - want.float()).abs().max().item() if got.shape == want.shape \
            else float("inf")
        if not error <= tolerance * (1 + want.abs().max().item()):
            raise RuntimeError(f"{where}: differs from its kind's graph (largest difference "
                               f"{error:.3g}); the key of its kind misses a setting")
