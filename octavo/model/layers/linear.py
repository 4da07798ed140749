"""Linear layers whose weights may be packed from several checkpoint tensors (q/k/v, gate/up).

The weight belongs to the layer's `quant_method` (octavo/model/quant/base.py): dense by default,
or the packed int4/int8 form of a quantized checkpoint or of --quantization. A dense layer may also
hold `decode_weight`, a packed copy for small batches made from a GGUF's codes (quant/gguf.py).
The bias stays dense.
"""
from __future__ import annotations

import torch
from torch import nn

from octavo.model.quant.base import UNQUANTIZED, QuantMethod


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` are the output widths of the checkpoint tensors packed in W."""

    def __init__(self, in_features: int, shards: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = shards
        self.bias = nn.Parameter(torch.zeros(sum(shards)), requires_grad=False) if bias else None
        self.decode_weight = None  # a GGUF layer's packed copy for decode (quant/gguf.py)
        self.quant_method: QuantMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self)

    def set_quant_method(self, method: QuantMethod) -> None:
        """Before loading: hand the weight to `method` (creates what it will be loaded into)."""
        self.quant_method = method
        method.create_weights(self)

    def load_shard(self, name: str, index: int | None, tensor: torch.Tensor) -> None:
        """Checkpoint tensor `name` (weight, bias, qweight, scales, ...) of packed slot `index`
        (None: a tensor spanning all slots)."""
        if name != "bias":
            self.quant_method.load_shard(self, name, index, tensor)
            return
        if self.bias is None:
            raise ValueError("checkpoint has a bias this layer was built without")
        start = sum(self.shards[:index]) if index is not None else 0
        width = self.shards[index] if index is not None else sum(self.shards)
        dest = self.bias.data.narrow(0, start, width)
        if dest.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint bias {tuple(tensor.shape)}, "
                             f"layer slot {tuple(dest.shape)}")
        dest.copy_(tensor)

    def process_after_load(self) -> None:
        self.quant_method.process_after_load(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return y if self.bias is None else y + self.bias
