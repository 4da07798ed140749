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
a dynamic token count, AOTInductor compiles it to a shared library kept as
`$OCTAVO_CACHE/compile/<hash of octavo's model and kernel code>/<kind>.so`. A start loads the
libraries through torch's C++ runner, without importing dynamo or inductor and without tracing
anything; a graph's call runs no Python guards.

A kind of layer is what decides its graph: its modules' types and settings, its description
(model/layer_spec.py), its tensors' shapes, what its opaque modules take and return, and
whether octavo's C++ kernels are loaded. Every layer is also checked against its graph at load
(opaque modules answering with a function of their inputs): a layer its kind's graph does not
reproduce there is an error naming it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octavo.kernels import fused
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.layers import opaque
from octavo.platform import cpu_platform

logger = logging.getLogger(__name__)

# The layers' code and the kernels' fakes (octavo/model, octavo/kernels).
_TRACED_CODE = [Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "kernels"]
_PROBE_TOKENS = (3, 1)  # the check's steps: several tokens, and the single token of decodes
_MAX_TOKENS = 1 << 20  # the graphs' bound on a step's token count
_PARTIAL = ".partial"  # the folder a graph is being made in
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
    """What a compiled library depends on beyond the layer: torch, the CPU's instructions
    (inductor compiles for this CPU's vector ISA) or the GPU, and whether octavo's C++ kernels
    are loaded (the layers' norms and rotary call them where they are, torch's ops where not:
    two different graphs)."""
    if device.type == "cuda":
        target = torch.cuda.get_device_name(device)
    else:
        target = cpu_platform().key()
    return f"{torch.__version__} {device.type} {target} native={fused.native_ready()}"


def _setting(value: Any, depth: int = 0) -> Any:
    """A setting (a module's attribute, a field of the layer's description) as it enters the key
    of its layer's kind: plain values as they are, functions by name and captured values,
    other objects by type and attributes. Tensors and modules by type: the layer's tensors
    enter the key by shape, its modules by their own settings."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, enum.Enum):
        return str(value)
    if isinstance(value, (torch.Tensor, nn.Module)) or depth > 3:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _setting(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return _setting((value.func, value.args, value.keywords), depth + 1)
    name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    if hasattr(value, "__code__"):  # a function: what it closes over decides what it does
        return name, _setting([c.cell_contents for c in value.__closure__ or ()], depth + 1)
    if callable(value) and hasattr(value, "__qualname__"):
        return name
    attributes = {k: v for k, v in getattr(value, "__dict__", {}).items()
                  if not k.startswith("_")}
    return type(value).__qualname__, _setting(attributes, depth + 1)


def _inside(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether `name` (a path in the layer) lies within one of its opaque modules."""
    return any(name.startswith(path + ".") for path in modules)


def _own_tensors(layer: nn.Module, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers outside its opaque modules (which use their own): the
    graph's inputs, by their names in the layer."""
    named = itertools.chain(layer.named_parameters(), layer.named_buffers())
    return {name: t.detach() for name, t in named if not _inside(name, modules)}


def _kind(layer: nn.Module, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor],
          calls: list[tuple], machine: str, dtype: torch.dtype) -> str:
    """The key of `layer`'s kind: what decides its graph."""
    parts: list[Any] = [machine, str(dtype)]
    for path, module in layer.named_modules():
        if _inside(path, modules):
            continue
        settings = () if path in modules else tuple(sorted(
            (k, _setting(v)) for k, v in vars(module).items() if not k.startswith("_")))
        parts.append((path, type(module).__module__, type(module).__qualname__, settings))
    description = layer.described()
    parts.append(tuple((field.name, _setting(getattr(description, field.name)))
                       for field in dataclasses.fields(description)))
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
             probe: tuple[torch.Tensor, torch.Tensor], folder: Path, key: str,
             device: torch.device) -> None:
    """Export `layer` with a dynamic token count and compile it into `folder` as `key`.so (its
    library) and `key`.json (its opaque calls), each written whole or not at all."""
    from torch._inductor import config as inductor_config  # only where a graph is made
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=_MAX_TOKENS)
    names = list(tensors)
    # The opaque op's fake looks its module up among the running ones, while export traces the
    # layer and again while inductor compiles it. Export refuses inference mode (the load's).
    with opaque.modules_of(modules), torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(
            _Flat(layer, names), (list(tensors.values()), *probe),
            dynamic_shapes=([None] * len(names), {0: tokens}, {0: tokens}), strict=False)
    if program.constants:
        raise NotImplementedError(
            f"compilation_level: {type(layer).__name__} holds tensors that are neither "
            f"parameters nor buffers ({sorted(program.constants)}); a graph would keep one "
            "layer's values for all")
    # Made in a folder of its own beside the graphs, removed whatever happens; only the
    # library and its table of opaque calls are kept, the library last (its presence is what
    # a start looks for). Torch's package loader would unpack the package into the system's
    # temporary folder at every start, and leave it there where a process exits without
    # running its destructors (engine processes do).
    with tempfile.TemporaryDirectory(dir=folder, prefix=f"{key}.", suffix=_PARTIAL) as work:
        # Fused kernels round where the eager ops round (bf16 after each op): in bf16 the graphs
        # give the eager layers' outputs exactly (tested). Their kernels run on one thread:
        # the layer's heavy work is in octavo's kernels and torch's ops, threaded by torch's
        # OpenMP pool, and inductor's code would start a second pool (the system's libgomp)
        # spinning beside it. On a GPU the kernels' binaries go inside the library.
        options = {"emulate_precision_casts": True, "cpp.threads": 1,
                   "aot_inductor.embed_kernel_binary": device.type == "cuda"}
        with opaque.modules_of(modules), inductor_config.patch(options):
            made = torch._inductor.aoti_compile_and_package(
                program, package_path=os.path.join(work, "graph.pt2"))
        with zipfile.ZipFile(made) as package:
            for suffix in (".json", ".so"):
                member, = [m for m in package.namelist() if m.endswith(".wrapper" + suffix)]
                with package.open(member) as source, \
                        open(os.path.join(work, key + suffix), "wb") as target:
                    shutil.copyfileobj(source, target)
                    os.fsync(target.fileno())  # whole on disk before it is named
                os.chmod(os.path.join(work, key + suffix), 0o644)
                os.replace(os.path.join(work, key + suffix), folder / (key + suffix))


class _Graph:
    """One kind of layer's compiled graph, loaded (its library beside its `.json`, which names
    the opaque calls for torch's runner)."""

    def __init__(self, library: Path, device: torch.device) -> None:
        self.library = library
        # torch's C++ runners (what torch._export.aot_load uses): importing torch._inductor
        # would import dynamo, most of a compiled start's cost.
        if device.type == "cuda":
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(library), 1,
                                                                      str(device))
        else:
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.runner.run(inputs)[0]


def _whole(library: Path) -> bool:
    """Whether a kind's graph is on disk: its library and its table of opaque calls."""
    return library.exists() and library.with_suffix(".json").exists()


def _graph(key: str, folder: Path, layer: nn.Module, modules: dict[str, nn.Module],
           tensors: dict[str, torch.Tensor], probe: tuple[torch.Tensor, torch.Tensor],
           device: torch.device) -> tuple[_Graph, bool]:
    """The graph of `key`'s kind, loaded from its library, made first where there is none (by
    one process at a time: tensor-parallel ranks make the same graphs)."""
    library = folder / f"{key}.so"
    if _whole(library):
        return _Graph(library, device), False
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # as the kernels' build: dropped if its holder dies
        made = not _whole(library)
        if made:
            # What a process killed while making this kind's graph left (the lock is ours).
            for stale in folder.glob(f"{key}.*{_PARTIAL}"):
                shutil.rmtree(stale)
            logger.info("compilation level: making the graph of %s's kind of layer (once: "
                        "later starts load it)", type(layer).__name__)
            _compile(layer, modules, tensors, probe, folder, key, device)
    return _Graph(library, device), made


def _probe(tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step of `tokens` for the check: random activations at positions out of order (within
    the shortest rotary table a model has)."""
    generator = torch.Generator().manual_seed(tokens)
    positions = torch.randperm(tokens, generator=generator).to(device)
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
    # Inductor's own caches (its precompiled headers, kernels) beside the libraries.
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

    inner.compiled_layers = CompiledLayers(runs, len(graphs), made, dtype)
    logger.info("compilation level %d: %d decoder layers run as %d AOTInductor graphs (%d made, "
                "the rest loaded from %s) in %.2f s", level, len(layers), len(graphs), made,
                folder, time.perf_counter() - start)


class CompiledLayers:
    """A model's decoder layers as their graphs (what run_layers calls)."""

    def __init__(self, runs: dict[int, tuple[_Graph, list[torch.Tensor], dict[str, nn.Module]]],
                 kinds: int, made: int, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the activations' (the graphs were made for it)
        self.runs = runs  # by the layer's id: its graph, own tensors and opaque modules
        self.kinds = kinds  # graphs, one per kind of layer
        self.made = made  # of which made at this start (the rest loaded)

    def __call__(self, stack: nn.ModuleList, positions: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
        # The libraries do not check their inputs (torch's runner leaves that to a debug build)
        if x.dtype != self.dtype or not x.is_contiguous() or positions.dtype != torch.int64 \
                or not x.shape[0]:
            raise RuntimeError(f"compiled layers take contiguous {self.dtype} activations of at "
                               f"least one token at int64 positions, got {x.dtype} "
                               f"{tuple(x.shape)} at {positions.dtype}")
        for layer in stack:
            graph, inputs, modules = self.runs[id(layer)]
            with opaque.modules_of(modules):
                x = graph([*inputs, positions, x])
        return x


def _check(number: int, layer: nn.Module, graph: _Graph, inputs: list[torch.Tensor],
           modules: dict[str, nn.Module], probes: list[tuple[torch.Tensor, torch.Tensor]],
           expected: list[torch.Tensor]) -> None:
    """`graph` gives `layer`'s eager outputs over the probes, up to rounding (a graph of another
    kind misses by far more; that the graphs round as the eager ops do is the tests' to show)."""
    tolerance = 1e-4 if expected[0].dtype == torch.float32 else 1e-2
    for probe, want in zip(probes, expected):
        where = (f"compilation_level: decoder layer {number} ({type(layer).__name__}) over "
                 f"{probe[1].shape[0]} tokens")
        try:
            with _echoing(modules, []):
                got = graph([*inputs, *probe])
        except RuntimeError as error:
            raise RuntimeError(f"{where}: its kind's graph ({graph.library}) fails: "
                               f"{error}") from error
        error = (got.float() - want.float()).abs().max().item() if got.shape == want.shape \
            else float("inf")
        if not error <= tolerance * (1 + want.abs().max().item()):
            raise RuntimeError(f"{where}: differs from its kind's graph (largest difference "
                               f"{error:.3g}); the key of its kind misses a setting")
