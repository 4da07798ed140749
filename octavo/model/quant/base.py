"""Quantization as a strategy of the linear layer: a `QuantMethod` creates the layer's weights,
takes the checkpoint's tensors, turns them into the form it computes with once they are all in
(`process_after_load`), and computes `apply`. A new format adds a method, never a model file.

- `UnquantizedMethod`: a dense weight [N, K], and maybe a packed copy for small batches.
- `GGUFMethod` (gguf.py): a GGUF's codes as int4/int8, alone or as the dense layer's copy.
- `CheckpointMethod`: collects a pre-quantized checkpoint's tensors per packed slot (q, k, v...)
  and builds one packed weight for the whole layer (GPTQ/AWQ in gptq.py, FP8 in fp8.py).
- `OnTheFlyMethod`: loads dense and quantizes each layer as soon as all its slots are in, so at
  most one layer is held dense beside the packed ones (--quantization int8|int4|fp8).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from octavo.model.quant.decode_weights import small_batch_linear
from octavo.model.quant.packed import PackedWeight


class QuantMethod:
    """The strategy a `Linear` delegates its weight to. `index` is the packed slot (q, k, v...),
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
        """Called once every checkpoint tensor is in."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N], without the bias (the layer adds it)."""
        raise NotImplementedError


def _slot(layer: nn.Module, index: int | None) -> tuple[int, int]:
    if index is None:
        return 0, sum(layer.shards)
    return sum(layer.shards[:index]), layer.shards[index]


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(layer.shards), layer.in_features),
                                    requires_grad=False)

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        if name != "weight":
            raise ValueError(f"checkpoint tensor {name!r} on an unquantized layer (is the "
                             "checkpoint's quantization_config missing?)")
        start, width = _slot(layer, index)
        dest = layer.weight.data.narrow(0, start, width)
        if dest.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, "
                             f"layer slot {tuple(dest.shape)}")
        dest.copy_(tensor)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, layer.weight, None, layer.decode_weight)


UNQUANTIZED = UnquantizedMethod()


def packed_apply(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    y = packed.matmul(x.reshape(-1, x.shape[-1]))
    return y.reshape(*lead, y.shape[-1])


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
        if "weight" in layer._parameters:
            del layer._parameters["weight"]  # never filled: the packed form replaces it
        layer.weight = None
        layer.checkpoint_parts = {}

    # GPTQ and AWQ store [inputs (or groups), outputs]; g_idx gives each input's group.
    _DIMS = {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0), "g_idx": (None, 0),
             "input_scale": (None, None)}

    def tensor_dims(self, name: str) -> tuple[int | None, int | None]:
        return self._DIMS.get(name, (0, 1))

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        layer.checkpoint_parts.setdefault(index, {})[name] = tensor

    def process_after_load(self, layer: nn.Module) -> None:
        parts = layer.checkpoint_parts
        if None in parts:
            slots, widths = [parts[None]], [sum(layer.shards)]
        else:
            missing = [i for i in range(len(layer.shards)) if i not in parts]
            if missing:
                raise ValueError(f"{self.fmt} checkpoint lacks the tensors of slot(s) "
                                 f"{missing} of a packed layer")
            slots, widths = [parts[i] for i in range(len(layer.shards))], layer.shards
        built = self.builder(slots, widths, layer.in_features, self.dtype)
        del layer.checkpoint_parts
        if isinstance(built, torch.Tensor):
            layer.weight = nn.Parameter(built, requires_grad=False)
        else:
            layer.packed = built

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.weight is not None:
            return small_batch_linear(x, layer.weight, None, None)
        return packed_apply(layer.packed, x)


class OnTheFlyMethod(QuantMethod):
    """Loads dense weights, then `quantize(weight [N, K], dtype)` replaces them once every slot
    of the layer is in: a packed weight, or a dense tensor (fp8 rounding computed in bf16)."""

    def __init__(self, name: str, quantize: Callable[[torch.Tensor, torch.dtype], object],
                 dtype: torch.dtype) -> None:
        self.name, self.quantize, self.dtype = name, quantize, dtype

    def create_weights(self, layer: nn.Module) -> None:
        UNQUANTIZED.create_weights(layer)
        layer.slots_loaded = set()

    def load_shard(self, layer: nn.Module, name: str, index: int | None,
                   tensor: torch.Tensor) -> None:
        UNQUANTIZED.load_shard(layer, name, index, tensor)
        layer.slots_loaded.update(range(len(layer.shards)) if index is None else [index])
        if len(layer.slots_loaded) == len(layer.shards):
            self.process_after_load(layer)

    def process_after_load(self, layer: nn.Module) -> None:
        if layer.slots_loaded is None:  # already quantized when its last slot came in
            return
        layer.slots_loaded = None
        built = self.quantize(layer.weight.data, self.dtype)
        if isinstance(built, torch.Tensor):
            layer.weight.data = built
        else:
            layer.packed = built
            del layer._parameters["weight"]
            layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.weight is not None:
            return small_batch_linear(x, layer.weight, None, None)
        return packed_apply(layer.packed, x)
