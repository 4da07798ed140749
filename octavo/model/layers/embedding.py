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
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]"""
        return small_batch_linear(hidden, self.weight, None, self.decode_weight).float()

    def set_decode_bits(self, bits: int) -> None:
        self.decode_weight = make_decode_weight(self.weight.data, bits)
