"""Token embedding and the LM head that may share its weight; both vocabulary-parallel under
tensor parallelism.

With N tensor-parallel ranks each holds ceil(vocab / N) consecutive vocabulary rows (the last
rank's past the vocabulary are zeros): the embedding looks up the ids in its rows and the ranks'
results are summed; the LM head computes its rows' logits and the ranks' logits are gathered.
Checkpoint tensors are cut to a rank's rows as they load (`weight_loader`), so no rank holds the
whole matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed import parallel_state
from octavo.model.quant.decode_weights import make_decode_weight
from octavo.model.quant.weights import DenseWeights, LinearWeights, PackedWeights


def _vocab_rows(vocab_size: int) -> tuple[int, int]:
    """(first row, rows) of this rank's share of the vocabulary."""
    size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    rows = -(-vocab_size // size)
    return rank * rows, rows


def _load_vocab_rows(param: nn.Parameter, tensor: torch.Tensor, vocab_size: int) -> None:
    if tensor.shape != (vocab_size, param.shape[1]):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}, model shape "
                         f"{(vocab_size, param.shape[1])}")
    first, rows = _vocab_rows(vocab_size)
    have = max(0, min(rows, vocab_size - first))
    param.data[:have].copy_(tensor[first:first + have])
    param.data[have:].zero_()


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.first_row, rows = _vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda param, tensor: _load_vocab_rows(param, tensor,
                                                                           vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel_state.tp_all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(nn.Module):
    """Logits from the final hidden states. Its `weight` is where the checkpoint's tensor loads
    (or the tied embedding's); after loading it computes with one typed weights object
    (quant/weights.py): dense, maybe with a low-bit copy for small batches (a GGUF's, made at
    the width of its source: `set_decode_bits`), or that copy alone (`packed_only`). An untied
    head's parameter goes once its weights are made; a tied one's stays the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Embedding | None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        self.weights: LinearWeights | None = None  # set once loaded
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            _, rows = _vocab_rows(vocab_size)
            self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
            self.weight.weight_loader = lambda param, tensor: _load_vocab_rows(param, tensor,
                                                                               vocab_size)
        self.weights_shape = tuple(self.weight.shape)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]"""
        logits = self.weights.matmul(hidden).float()
        if parallel_state.tp_size() == 1:
            return logits
        return parallel_state.tp_all_gather(logits, -1)[:, :self.vocab_size]

    def process_after_load(self) -> None:
        self.set_weights(DenseWeights(self.weight if self.tied else self.weight.data))

    def set_weights(self, weights: LinearWeights) -> None:
        """The finished weights (after loading, or read back from prepared weights)."""
        if weights.shape != self.weights_shape:
            raise ValueError(f"weights of shape {weights.shape} for an LM head of "
                             f"{self.weights_shape}")
        if not self.tied:
            self._parameters.pop("weight", None)
        self.weights = weights

    def set_decode_bits(self, bits: int) -> None:
        """The low-bit copy for small batches of a head whose source had `bits` per weight."""
        dense = self.weights.weight
        self.weights = DenseWeights(dense, make_decode_weight(dense.data, bits))

    def packed_only(self) -> bool:
        """Keep only the low-bit copy of an untied head, which then serves every batch (a GGUF
        with --quantization int4|int8); True if the dense weight was dropped."""
        if self.tied or not isinstance(self.weights, DenseWeights) or (
                self.weights.small_batch is None):
            return False
        self.weights = PackedWeights(self.weights.small_batch)
        return True
