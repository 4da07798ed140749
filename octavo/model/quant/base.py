"""Quantization as a strategy of the linear layer: a `QuantMethod` creates what the layer's
checkpoint tensors load into, takes them, and once they are all in (`process_after_load`) gives
the layer its one typed weights object (quant/weights.py), whose kernel is bound from then on.
A new format adds a method, never a model file.

- `UnquantizedMethod`: a dense weight [N, K] -> `DenseWeights`.
- `GGUFMethod` (gguf.py): a GGUF's codes as int4/int8 -> `PackedWeights`, or `DenseWeights`
  with them as its small-batch copy.
- `CheckpointMethod`: collects a pre-quantized checkpoint's tensors per packed slot (q, k, v...)
  and builds one packed weight for the whole layer (GPTQ/AWQ in gptq.py, FP8 in fp8.py).
- `OnTheFlyMethod`: loads dense and quantizes each layer as soon as all its slots are in, so at
  most one layer is held dense beside the packed ones (--quantization int8|int4|fp8).

While loading, a dense weight is the layer's `weight` parameter (so a checkpoint that lacks one
is named by the model's loader) and a method's collected tensors sit in `layer.loading`; the
weights object replaces both (`Linear.set_weights`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from octavo.model.quant.packed import PackedWeight
from octavo.model.quant.weights import DenseWeights, LinearWeights, PackedWeights

# MoE routers (Mixtral's and Qwen's gate, Qwen2-MoE's shared expert gate, gpt-oss's and Llama
# 4's router): they pick the experts, and stay dense under every quantization
ROUTERS = (".gate", "shared_expert_gate", ".router")


@dataclass
class Loading:
    """What a method holds of one layer while its checkpoint tensors stream in: tensors per
    packed slot (None: one tensor spanning every slot), and what it built once all were in."""

    parts: dict[int | None, dict[str, torch.Tensor]] = field(default_factory=dict)
    built: PackedWeight | None = None


class QuantMethod:
    """The strategy a `Linear` delegates its weights to. `index` is the packed slot (q, k, v...),
    or None for a checkpoint tensor that already spans every slot (Phi-3's qkv_proj)."""

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def tensor_dims(self, name: str) -> tuple[int | None, int | None]:
        """Which dimension of checkpoint tensor `name` runs along the layer's outputs and which
        along its inputs (None: neither), so tensor parallelism can cut a rank's share of any
        format by one rule (layers/linear.py)."""
        return 0, 1

    def process_after_load(self, layer: nn.Module) -> None:
        """Called once every checkpoint tensor is in: `layer.set_weights(...)`."""
        raise NotImplementedError


def _slot(layer: nn.Module, index: int | None) -> tuple[int, int]:
    if index is None:
        return 0, sum(layer.shards)
    return sum(layer.shards[:index]), layer.shards[index]


def dense_destination(layer: nn.Module, dtype: torch.dtype | None = None) -> None:
    """The `weight` parameter [N, K] a dense checkpoint weight loads into (the default dtype and
    device unless `dtype` is given)."""
    layer.weight = nn.Parameter(torch.empty(sum(layer.shards), layer.in_features, dtype=dtype),
                                requires_grad=False)


def load_dense(layer: nn.Module, index: int | None, tensor: torch.Tensor) -> None:
    start, width = _slot(layer, index)
    dest = layer.weight.data.narrow(0, start, width)
    if dest.shape != tensor.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, "
                         f"layer slot {tuple(dest.shape)}")
    dest.copy_(tensor)


def built_weights(built: PackedWeight | torch.Tensor) -> LinearWeights:
    """A format's result: a packed weight, or a dense tensor it computes in the activation dtype."""
    return DenseWeights(built) if isinstance(built, torch.Tensor) else PackedWeights(built)


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: nn.Module) -> None:
        dense_destination(layer)

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        if name != "weight":
            raise ValueError(f"checkpoint tensor {name!r} on an unquantized layer (is the "
                             "checkpoint's quantization_config missing?)")
        load_dense(layer, index, tensor)

    def process_after_load(self, layer: nn.Module) -> None:
        layer.set_weights(DenseWeights(layer.weight.data))


UNQUANTIZED = UnquantizedMethod()


# A format's builder: (per-slot checkpoint tensors, slot widths, in_features, dtype) -> either a
# packed weight or a dense tensor [N, K] in `dtype` (formats computed in the activation dtype).
Builder = Callable[[list[dict[str, torch.Tensor]], list[int], int, torch.dtype],
                   "PackedWeight | torch.Tensor"]


class CheckpointMethod(QuantMethod):
    """A pre-quantized checkpoint's layer: its tensors (qweight, scales, ...) per slot, then one
    packed weight built by `builder`. `fmt` names the format in errors."""

    def __init__(self, fmt: str, builder: Builder, dtype: torch.dtype) -> None:
        self.fmt, self.builder, self.dtype = fmt, builder, dtype

    def create_weights(self, layer: nn.Module) -> None:
        layer.loading = Loading()

    # GPTQ and AWQ store [inputs (or groups), outputs]; g_idx gives each input's group.
    _DIMS = {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0), "g_idx": (None, 0),
             "input_scale": (None, None)}

    def tensor_dims(self, name: str) -> tuple[int | None, int | None]:
        return self._DIMS.get(name, (0, 1))

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        layer.loading.parts.setdefault(index, {})[name] = tensor

    def process_after_load(self, layer: nn.Module) -> None:
        parts = layer.loading.parts
        if None in parts:
            slots, widths = [parts[None]], [sum(layer.shards)]
        else:
            missing = [i for i in range(len(layer.shards)) if i not in parts]
            if missing:
                raise ValueError(f"{self.fmt} checkpoint lacks the tensors of slot(s) "
                                 f"{missing} of a packed layer")
            slots, widths = [parts[i] for i in range(len(layer.shards))], layer.shards
        layer.set_weights(built_weights(self.builder(slots, widths, layer.in_features,
                                                     self.dtype)))


class OnTheFlyMethod(QuantMethod):
    """Loads dense weights, then `quantize(weight [N, K], dtype)` replaces them once every slot
    of the layer is in: a packed weight, or a dense tensor (fp8 rounding computed in bf16)."""

    def __init__(self, name: str, quantize: Callable[[torch.Tensor, torch.dtype], object],
                 dtype: torch.dtype) -> None:
        self.name, self.quantize, self.dtype = name, quantize, dtype

    def create_weights(self, layer: nn.Module) -> None:
        dense_destination(layer)
        layer.loading = Loading()

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        UNQUANTIZED.load_shard(layer, name, index, tensor)
        parts = layer.loading.parts  # the slots filled so far
        parts.update(dict.fromkeys(range(len(layer.shards)) if index is None else [index], {}))
        if len(parts) == len(layer.shards):
            self.process_after_load(layer)

    def process_after_load(self, layer: nn.Module) -> None:
        if layer.loading is None:  # quantized already, when its last slot came in
            return
        layer.set_weights(built_weights(self.quantize(layer.weight.data, self.dtype)))
