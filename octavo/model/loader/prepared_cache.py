"""Prepared weights on disk: a GGUF model as octavo holds it in memory, saved once and reused.

Loading a GGUF means dequantizing every tensor, un-permuting q/k and packing the low-bit weights
(quant/gguf.py): seconds of work that gives the same result on every start. After the first load
the model's parameters, decode copies (`decode_weight`) and packed weights (`packed`, with
--quantization) are written to one safetensors file under `$OCTAVO_CACHE/prepared/`, keyed by the
GGUF file (path, size, mtime), the dtype, the decode mode or quantization, torch's version and the
source of octavo's model code, so any change to one of them makes a new entry (and removes the
entry it replaces). Later starts read that file instead. A file that fails to load is rebuilt.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from octavo.disk_cache import write_file
from octavo.distributed import parallel_state
from octavo.model.quant.gguf import GGUFMethod
from octavo.model.quant.packed import PACKED_KINDS, packed_kind
from octavo.model_source import ModelSource, cache_dir

logger = logging.getLogger(__name__)

_MODEL_CODE = Path(__file__).resolve().parents[1]  # octavo/model
# module attribute holding a packed weight -> its key prefix in the file
_PACKED_ATTRS = {"decode_weight": "__decode__", "packed": "__packed__"}


def prepared_path(source: ModelSource, dtype: torch.dtype, decode_weights: str,
                  quantization: str | None = None) -> Path:
    stat = source.path.stat()
    mode = quantization or decode_weights  # a GGUF's int4/int8 ignore decode_weights
    where = parallel_state.placement()  # a rank prepares its own share and stage
    if where.world_size > 1:
        mode = f"{mode}-tp{where.tp_rank}of{where.tp_size}-pp{where.pp_rank}of{where.pp_size}"
    h = hashlib.sha256()
    for part in (str(source.path.resolve()), stat.st_size, stat.st_mtime_ns, str(dtype),
                 mode, torch.__version__):
        h.update(str(part).encode() + b"\0")
    for f in sorted(_MODEL_CODE.rglob("*.py")):
        h.update(f.read_bytes())
    dtype_name = str(dtype).removeprefix("torch.")
    return (cache_dir() / "prepared"
            / f"{source.path.stem}-{dtype_name}-{mode}-{h.hexdigest()[:16]}.safetensors")


def save_prepared(model: nn.Module, path: Path) -> None:
    tensors = {name: p.data.contiguous() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        for attr, prefix in _PACKED_ATTRS.items():
            packed = getattr(module, attr, None)
            if packed is not None:
                for key, t in packed.tensors().items():
                    tensors[f"{prefix}.{packed_kind(packed)}.{name}.{key}"] = t.contiguous()
    # Whole or not at all (disk_cache): a full disk or a read-only cache costs the next start
    # the dequantizing, never this one. safetensors reports I/O errors as SafetensorError.
    if write_file(path, lambda tmp: save_file(tensors, str(tmp)), "prepared weights",
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
        tensors = load_file(str(path))
    except Exception as exc:  # a truncated or foreign file: rebuild it
        logger.warning("prepared weights %s unreadable (%s); rebuilding", path, exc)
        return False
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        prefix, _, rest = key.partition(".")
        if prefix in _PACKED_ATTRS.values():
            kind, rest = rest.split(".", 1)
            module, field = rest.rsplit(".", 1)
            packed.setdefault((prefix, kind, module), {})[field] = t
    # layers waiting for their GGUF codes (quant/gguf.py) must all get a packed weight here
    waiting = {n for n, m in modules.items() if isinstance(getattr(m, "quant_method", None),
                                                           GGUFMethod)}
    if (not set(params) <= set(tensors) or not waiting <= {m for _, _, m in packed}
            or any(m not in modules for _, _, m in packed)):
        logger.warning("prepared weights %s do not match the model; rebuilding", path)
        return False
    for name, p in params.items():
        p.data = tensors[name]
    for (prefix, kind, name), parts in packed.items():
        weight = PACKED_KINDS[kind].from_tensors(parts)
        module = modules[name]
        if name in waiting:
            module.quant_method.restore(module, weight)
        else:
            setattr(module, next(a for a, p in _PACKED_ATTRS.items() if p == prefix), weight)
    return True
