"""Prepared weights on disk: a GGUF model as octavo holds it in memory, saved once and reused.

Loading a GGUF means dequantizing every tensor, un-permuting q/k and re-packing the low-bit decode
copies: seconds of work that gives the same result on every start. After the first load the
model's parameters and decode copies are written to one safetensors file under
`$OCTAVO_CACHE/prepared/`, keyed by the GGUF file (path, size, mtime), the dtype, the decode
mode, torch's version and the source of octavo's model code, so any change to one of them makes a
new entry (and removes the entry it replaces). Later starts read that file instead. A file that
fails to load is rebuilt.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from octavo.model.quant.decode_weights import DECODE_KINDS
from octavo.model_source import ModelSource, cache_dir

logger = logging.getLogger(__name__)

_MODEL_CODE = Path(__file__).resolve().parents[1]  # octavo/model
_DECODE = "__decode__"


def prepared_path(source: ModelSource, dtype: torch.dtype, decode_weights: str) -> Path:
    stat = source.path.stat()
    h = hashlib.sha256()
    for part in (str(source.path.resolve()), stat.st_size, stat.st_mtime_ns, str(dtype),
                 decode_weights, torch.__version__):
        h.update(str(part).encode() + b"\0")
    for f in sorted(_MODEL_CODE.rglob("*.py")):
        h.update(f.read_bytes())
    dtype_name = str(dtype).removeprefix("torch.")
    return (cache_dir() / "prepared"
            / f"{source.path.stem}-{dtype_name}-{decode_weights}-{h.hexdigest()[:16]}.safetensors")


def save_prepared(model: nn.Module, path: Path) -> None:
    tensors = {name: p.data.contiguous() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        decode = getattr(module, "decode_weight", None)
        if decode is not None:
            kind = next(k for k, cls in DECODE_KINDS.items() if isinstance(decode, cls))
            for key, t in decode.tensors().items():
                tensors[f"{_DECODE}.{kind}.{name}.{key}"] = t.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp))
        tmp.replace(path)  # atomic: a reader never sees half a file
        _remove_stale(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("could not save prepared weights to %s: %s", path, exc)


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
        tensors = load_file(str(path))
    except Exception as exc:  # a truncated or foreign file: rebuild it
        logger.warning("prepared weights %s unreadable (%s); rebuilding", path, exc)
        return False
    params = dict(model.named_parameters())
    if not set(params) <= set(tensors):
        logger.warning("prepared weights %s do not match the model; rebuilding", path)
        return False
    for name, p in params.items():
        p.data = tensors[name]
    modules = dict(model.named_modules())
    decode: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(_DECODE + "."):
            kind, rest = key[len(_DECODE) + 1:].split(".", 1)
            module, field = rest.rsplit(".", 1)
            decode.setdefault((kind, module), {})[field] = t
    for (kind, module), parts in decode.items():
        modules[module].decode_weight = DECODE_KINDS[kind].from_tensors(parts)
    return True
