"""Token embedding and the LM head that may share its weight; both vocabulary-parallel under
tensor parallelism.

With N tensor-parallel ranks each holds ceil(vocab / N) consecutive vocabulary rows (the last
rank's past the vocabulary are zeros): the embedding looks up the ids in its rows and the ranks'
results are summed; the LM head computes its rows' logits and the ranks' logits are gathered.
Checkpoint tensors are cut to a rank's rows as they load (`weight_loader`), so no rank holds the
whole matrix.

Both hold one typed weights object after loading (quant/weights.py), as linear layers do: the
embedding looks its rows up in it (`rows`), the head multiplies by it. A GGUF's embedding keeps
its low-bit codes (int8 per 32 for Q8_0, code for code; the nearest layout for other types),
shared with a tied head, so a 262k-token vocabulary costs its file size, not a dense table.
"""
from __future__ import annotations

import torch
from torch import nn

from octavo.distributed import parallel_state
from octavo.model.context import step_lora
from octavo.model.quant.decode_weights import make_decode_weight
from octavo.model.quant.weights import DenseWeights, LinearWeights, PackedWeights


def _vocab_rows(vocab_size: int) -> tuple[int, int]:
    """(first row, rows) of this rank's share of the vocabulary."""
    size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    rows = -(-vocab_size // size)
    return rank * rows, rows


def _set_weights(module: nn.Module, weights: LinearWeights) -> None:
    """`module.weights = weights`; its own `weight` parameter (where the checkpoint's tensor
    loaded) goes unless the weights compute from it."""
    if weights.shape != module.weights_shape:
        raise ValueError(f"weights of shape {weights.shape} for a {type(module).__name__} of "
                         f"{module.weights_shape}")
    param = module._parameters.get("weight")
    if param is not None and not any(t is param for t in weights.tensors().values()):
        del module._parameters["weight"]
    module.weights = weights


def _load_vocab_rows(param: nn.Parameter, tensor: torch.Tensor, vocab_size: int) -> None:
    if tensor.shape != (vocab_size, param.shape[1]):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}, model shape "
                         f"{(vocab_size, param.shape[1])}")
    first, rows = _vocab_rows(vocab_size)
    have = max(0, min(rows, vocab_size - first))
    param.data[:have].copy_(tensor[first:first + have])
    param.data[have:].zero_()


class Embedding(nn.Module):
    lora = None  # the adapters' slots (model/layers/lora.py), where LoRA is on

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.first_row, rows = _vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda param, tensor: _load_vocab_rows(param, tensor,
                                                                           vocab_size)
        self.weights_shape = tuple(self.weight.shape)
        self.weights: LinearWeights | None = None  # set once loaded

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.tp_size() == 1:
            x = self.weights.rows(input_ids)
        else:
            local = input_ids - self.first_row
            outside = (local < 0) | (local >= self.weights_shape[0])
            x = self.weights.rows(local.masked_fill(outside, 0))
            x = parallel_state.tp_all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
        if self.lora is not None and (lora := step_lora()) is not None:
            # every rank holds all of A
            x = self.lora.add_delta(input_ids, x, lora.token_slot, lora.slots)
        return x

    def process_after_load(self) -> None:
        self.set_weights(DenseWeights(self.weight))

    def set_weights(self, weights: LinearWeights) -> None:
        """The finished weights (after loading, or read back from prepared weights)."""
        _set_weights(self, weights)


class LMHead(nn.Module):
    """Logits from the final hidden states. Its `weight` is where the checkpoint's tensor loads
    (or the tied embedding's); after loading it computes with one typed weights object
    (quant/weights.py): dense, maybe with a low-bit copy for small batches (a GGUF's, made at
    the width of its source: `set_decode_bits`), or that copy alone (`packed_only`). An untied
    head's parameter goes once its weights are made; a tied one's stays the embedding's."""

    lora = None  # the adapters' slots (model/layers/lora.py), where LoRA is on

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Embedding | None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.first_row, _ = _vocab_rows(vocab_size)
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
        logits = self.weights.matmul(hidden)
        if self.lora is not None and (lora := step_lora()) is not None:
            # this rank's vocabulary rows of B; the rows hidden holds are the sampled ones
            rows = lora.token_slot if lora.sample_slot is None else lora.sample_slot
            logits = self.lora.add_delta(hidden, logits, rows, lora.slots)
        logits = logits.float()
        if parallel_state.tp_size() == 1:
            return logits
        return parallel_state.tp_all_gather(logits, -1)[:, :self.vocab_size]

    def process_after_load(self) -> None:
        self.set_weights(DenseWeights(self.weight if self.tied else self.weight.data))

    def set_weights(self, weights: LinearWeights) -> None:
        """The finished weights (after loading, or read back from prepared weights)."""
        _set_weights(self, weights)

    def set_decode_bits(self, bits: int) -> None:
        """The low-bit copy for small batches of a head whose source had `bits` per weight."""
        dense = self.weights.weight
        self.weights = DenseWeights(dense, make_decode_weight(dense.data, bits))

    def packed_only(self, embedding: Embedding | None) -> bool:
        """Keep only the low-bit copy, which then serves every batch (a GGUF's default); a tied
        head's embedding looks its rows up in the same copy. True if the dense weight went."""
        if not isinstance(self.weights, DenseWeights) or self.weights.small_batch is None:
            return False
        packed = PackedWeights(self.weights.small_batch)
        if self.tied:
            if embedding is None:
                return False
            embedding.set_weights(packed)
        self.set_weights(packed)
        return True
