"""A linear layer's weights as they compute, one typed object per layer (`Linear.weights`, and
the LM head's): what its quant method finished once every checkpoint tensor was in.

- `DenseWeights`: a dense [N, K] weight, plain or packed for oneDNN's GEMM (`pack_for_onednn`,
  a step taken at load or, in the worker, a few layers at a time: loader/gemm_packing.py), and
  maybe a low-bit copy that computes small batches (`small_batch`: a GGUF's codes, or the LM
  head's copy; decode_weights.py says up to how many rows).
- `PackedWeights`: packed int4 / int8 weights alone (packed.py), for every batch.

The quant method picks the type once, after load, and the type is the kernel: a forward call is
one `matmul` on it, never a look at which of several attributes the layer holds. (Kernels chosen
once per object as bound methods were tried: a bound method kept in its own object is a reference
cycle, and the start's cycles are frozen, never collected: startup_gc.py.) `tensors()` and
`from_tensors()` save and restore one by its `kind` (prepared weights, loader/prepared_cache.py);
the fused decode stack reads them by type (model/decode_stack.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import onednn
from octavo.model.quant.decode_weights import max_rows
from octavo.model.quant.microscaled import MicroscaledPacked
from octavo.model.quant.packed import Int4Packed, Int8Grouped, Int8Packed, PackedWeight

# Each packed weight class by the name its tensors are saved under (prepared weights) and the
# start-up log counts it by.
PACKED_KINDS: dict[str, type[PackedWeight]] = {"int4": Int4Packed, "int8": Int8Packed,
                                               "int8g": Int8Grouped, "mx": MicroscaledPacked}


def packed_kind(w: PackedWeight) -> str:
    return next(k for k, cls in PACKED_KINDS.items() if type(w) is cls)


class LinearWeights:
    """x [..., K] -> `matmul(x)` [..., N], without the bias (the layer adds it)."""

    kind: str

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding's lookup), [*ids.shape, K]."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)"""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> LinearWeights:
        raise NotImplementedError


def _packed_tensors(prefix: str, packed: PackedWeight) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{packed_kind(packed)}.{k}": v for k, v in packed.tensors().items()}


def _packed_from(prefix: str, t: dict[str, torch.Tensor]) -> PackedWeight | None:
    """The packed weight saved under `prefix` by _packed_tensors (None if there is none)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in t.items():
        head, _, rest = key.partition(".")
        if head == prefix:
            kind, _, field = rest.partition(".")
            parts.setdefault(kind, {})[field] = value
    if len(parts) > 1 or any(k not in PACKED_KINDS for k in parts):
        raise ValueError(f"saved weights hold packed kinds {sorted(parts)} under {prefix!r}")
    return next((PACKED_KINDS[k].from_tensors(p) for k, p in parts.items()), None)


class DenseWeights(LinearWeights):
    """A dense weight [N, K] and, maybe, its low-bit copy for batches of up to
    max_rows(small_batch) rows (the copy's rows bound is asked per call: the C++ kernels that
    raise it may finish loading after the weights)."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, small_batch: PackedWeight | None = None) -> None:
        self.weight = weight  # plain, or packed for oneDNN (opaque; onednn.dense gives it back)
        self.small_batch = small_batch

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        small = self.small_batch
        if (small is not None and x.dim() == 2 and x.dtype == small.dtype
                and x.shape[0] <= max_rows(small)):
            return small.matmul(x)
        return onednn.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # an embedding's table is never packed for oneDNN

    def packable(self) -> bool:
        return onednn.packable(self.weight)

    def pack_for_onednn(self) -> None:
        """The weight in oneDNN's GEMM layout from here on: the same products, sooner."""
        self.weight = onednn.pack(self.weight.data)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight}
        return out if self.small_batch is None else {
            **out, **_packed_tensors("small_batch", self.small_batch)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> DenseWeights:
        return cls(t["weight"], _packed_from("small_batch", t))


class PackedWeights(LinearWeights):
    """Packed int4 / int8 weights alone: its kernels for small batches, dequantized tiles and the
    dense GEMM for large ones (PackedWeight.matmul)."""

    kind = "packed"

    def __init__(self, packed: PackedWeight) -> None:
        self.packed = packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.out_features, self.packed.in_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.packed.matmul(x.reshape(-1, x.shape[-1]))
        return y.reshape(*lead, y.shape[-1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.rows(ids.reshape(-1)).reshape(*ids.shape, self.packed.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        return _packed_tensors("packed", self.packed)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> PackedWeights:
        packed = _packed_from("packed", t)
        if packed is None:
            raise ValueError("saved packed weights hold no packed tensors")
        return cls(packed)


WEIGHT_KINDS: dict[str, type[LinearWeights]] = {"dense": DenseWeights, "packed": PackedWeights}


def allow_quantized_activations(model: torch.nn.Module) -> None:
    """Lets every packed weight of `model` take its activations quantized where a kernel
    computes them (`--dtype auto`'s plan; PackedWeight.quantized_activations)."""
    for module in model.modules():
        weights = getattr(module, "weights", None)
        if isinstance(weights, PackedWeights):
            weights.packed.quantized_activations = True
