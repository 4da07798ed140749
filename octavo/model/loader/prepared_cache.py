"""Prepared weights on disk: a GGUF model as octavo holds it in memory, saved once and reused.

Loading a GGUF means dequantizing every tensor, un-permuting q/k and packing the low-bit weights
(quant/gguf.py): seconds of work that gives the same result on every start. After the first load
the model's parameters and each linear layer's and LM head's typed weights (quant/weights.py:
`tensors()` under `<module>::<kind>::<field>`, a tensor that is a parameter, such as a tied
head's, named in the metadata instead) are written to one safetensors file under
`$OCTAVO_CACHE/prepared/`, keyed by the GGUF file (path, size, mtime), the dtype, the decode
mode or quantization, torch's version, whether the C++ kernels are loaded and the source of
octavo's model code, so any change to one of them makes a new entry (and removes the entry it
replaces). Later starts read that file
instead. A file that fails to load, or does not match the model (another layout, a file of
older code), is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from octavo.disk_cache import write_file
from octavo.distributed import parallel_state
from octavo.kernels import fused
from octavo.model.quant.weights import WEIGHT_KINDS, LinearWeights
from octavo.model_source import ModelSource, cache_dir

logger = logging.getLogger(__name__)

_MODEL_CODE = Path(__file__).resolve().parents[1]  # octavo/model
# The layout of the file (1: decode_weight / packed attributes; 2: no embedding weights objects).
FORMAT = "octavo-prepared-3"


def prepared_path(source: ModelSource, dtype: torch.dtype, decode_weights: str,
                  quantization: str | None = None, dense_prefill: bool = False) -> Path:
    stat = source.path.stat()
    mode = quantization or decode_weights  # a GGUF's int4/int8 ignore decode_weights
    if dense_prefill and quantization is None and decode_weights == "auto":
        mode = "dense-prefill"
    where = parallel_state.placement()  # a rank prepares its own share and stage
    if where.global_world_size > 1:
        mode = f"{mode}-tp{where.tp_rank}of{where.tp_size}-pp{where.pp_rank}of{where.pp_size}"
        if where.expert_parallel:  # its experts: those of its place over every joined rank
            mode = f"{mode}-ep{where.ep_rank}of{where.ep_size}"
    h = hashlib.sha256()
    # The packed forms chosen depend on whether the C++ kernels are loaded (quant/gguf.py: the
    # wide int4 codes need them): a start without them must not leave its weights to one with.
    for part in (str(source.path.resolve()), stat.st_size, stat.st_mtime_ns, str(dtype),
                 mode, torch.__version__, fused.native_ready()):
        h.update(str(part).encode() + b"\0")
    for f in sorted(_MODEL_CODE.rglob("*.py")):
        h.update(f.read_bytes())
    dtype_name = str(dtype).removeprefix("torch.")
    return (cache_dir() / "prepared"
            / f"{source.path.stem}-{dtype_name}-{mode}-{h.hexdigest()[:16]}.safetensors")


def _takers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose weights are one typed object (linear layers, embeddings, the LM
    head)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "set_weights")}


def save_prepared(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters())
    param_names = {id(p): name for name, p in params.items()}
    tensors = {name: p.data.contiguous() for name, p in params.items()}
    shared: dict[str, str] = {}  # a key -> the parameter or earlier key holding its tensor
    saved: dict[int, str] = {}  # tensors two takers share (a tied head's and its embedding's)
    for name, module in _takers(model).items():
        weights = module.weights
        for field, t in weights.tensors().items():
            key = f"{name}::{weights.kind}::{field}"
            if id(t) in param_names:
                shared[key] = param_names[id(t)]
            elif id(t) in saved:
                shared[key] = saved[id(t)]
            else:
                tensors[key] = t.contiguous()
                saved[id(t)] = key
    metadata = {"format": FORMAT, "shared": json.dumps(shared)}
    # Whole or not at all (disk_cache): a full disk or a read-only cache costs the next start
    # the dequantizing, never this one. safetensors reports I/O errors as SafetensorError.
    if write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata), "prepared weights",
                  errors=(SafetensorError,)):
        _remove_stale(path)


def _remove_stale(path: Path) -> None:
    """Entries of the same model, dtype and decode mode made by other code or torch versions
    are never read again; each is hundreds of MB."""
    prefix = path.name.rsplit("-", 1)[0]
    for old in path.parent.glob(f"{prefix}-*.safetensors"):
        if old != path and len(old.name) == len(path.name):
            old.unlink(missing_ok=True)


def load_prepared(model: nn.Module, path: Path) -> bool:
    """Fill `model` from a prepared file; False (model untouched) if there is none or it is bad."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # a truncated or foreign file: rebuild it
        logger.warning("prepared weights %s unreadable (%s); rebuilding", path, exc)
        return False
    try:
        fill, weights = _restore(model, tensors, metadata)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        logger.warning("prepared weights %s do not match the model (%s); rebuilding", path, exc)
        return False
    for param, t in fill:
        param.data = t
    takers = _takers(model)
    for name, w in weights.items():
        takers[name].set_weights(w)
    return True


def _restore(model: nn.Module, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
             ) -> tuple[list[tuple[nn.Parameter, torch.Tensor]], dict[str, LinearWeights]]:
    """What the file gives the model, checked against it before anything is changed: each kept
    parameter's tensor and each taker's weights."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, this code reads {FORMAT!r}")
    params = dict(model.named_parameters())
    takers = _takers(model)
    parts: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def add(key: str, t: torch.Tensor) -> None:
        module, kind, field = key.split("::", 2)
        entry = parts.setdefault(module, (kind, {}))
        if entry[0] != kind:
            raise ValueError(f"{module}: weights of kinds {entry[0]} and {kind}")
        entry[1][field] = t

    plain = {}
    for key, t in tensors.items():
        if "::" in key:
            add(key, t)
        else:
            plain[key] = t
    shared = json.loads(metadata.get("shared", "{}"))
    for key, name in shared.items():
        add(key, params[name] if name in params else tensors[name])
    if set(parts) != set(takers):
        raise ValueError(f"weights of {sorted(set(parts) ^ set(takers))[:3]}")
    weights = {}
    for name, (kind, fields) in parts.items():
        weights[name] = WEIGHT_KINDS[kind].from_tensors(fields)
        if weights[name].shape != tuple(takers[name].weights_shape):
            raise ValueError(f"{name}: weights of shape {weights[name].shape}")
    # A taker's own `weight` parameter is only where its checkpoint tensor loads, unless saved
    # weights compute from it (a dense embedding's table, shared by a tied LM head).
    kept_ids = {id(params[name]) for name in shared.values() if name in params}
    replaced = {id(m._parameters["weight"]) for m in takers.values()
                if "weight" in m._parameters} - kept_ids
    kept = {name: p for name, p in params.items() if id(p) not in replaced}
    if set(plain) != set(kept):
        raise ValueError(f"parameters {sorted(set(plain) ^ set(kept))[:3]}")
    fill = []
    for name, p in kept.items():
        if plain[name].shape != p.shape or plain[name].dtype != p.dtype:
            raise ValueError(f"{name}: {plain[name].dtype} {tuple(plain[name].shape)}")
        fill.append((p, plain[name]))
    return fill, weights
