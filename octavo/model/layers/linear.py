"""Linear layers whose weights may be packed from several checkpoint tensors (q/k/v, gate/up)."""
from __future__ import annotations

import torch
from torch import nn

from octavo.model.quant.decode_weights import make_decode_weight, small_batch_linear


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` are the output widths of the checkpoint tensors packed in W."""

    def __init__(self, in_features: int, shards: list[int], bias: bool = False) -> None:
        super().__init__()
        self.shards = shards
        out = sum(shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.decode_weight = None

    def load_shard(self, name: str, index: int, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `name` (weight or bias) into packed slot `index`."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError("checkpoint has a bias this layer was built without")
        start = sum(self.shards[:index])
        dest = param.data.narrow(0, start, self.shards[index])
        if dest.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, "
                             f"layer slot {tuple(dest.shape)}")
        dest.copy_(tensor)

    def set_decode_bits(self, bits: int) -> None:
        """Keep a low-bit copy for small batches when the source had `bits` bits per weight."""
        self.decode_weight = make_decode_weight(self.weight.data, bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias, self.decode_weight)
