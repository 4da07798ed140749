"""Token embedding and the LM head that may share its weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.model.quant.decode_weights import make_decode_weight, small_batch_linear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Embedding | None) -> None:
        super().__init__()
        self.decode_weight = None
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]"""
        if self.weight is None:  # packed only (packed_only())
            return self.decode_weight.matmul(hidden).float()
        return small_batch_linear(hidden, self.weight, None, self.decode_weight).float()

    def set_decode_bits(self, bits: int) -> None:
        self.decode_weight = make_decode_weight(self.weight.data, bits)

    def packed_only(self) -> bool:
        """Drop the dense weight of an untied head that has a packed copy, which then serves
        every batch (a GGUF with --quantization int4|int8); True if it was dropped."""
        if self.tied or self.decode_weight is None or self.weight is None:
            return False
        del self._parameters["weight"]
        self.weight = None
        return True
