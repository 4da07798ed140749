"""LoRA on a layer, for a batch that mixes adapters: the layer's output plus each token's own
adapter's `scaling * B (A x)`, computed per adapter over that adapter's tokens (the punica/
SGMV grouping on the CPU: one pass over each adapter's A and B, or a pair of GEMMs, per adapter
in the step and layer; never one forward pass per adapter).

The adapters live in `num_slots` preallocated slots per layer, filled and cleared by the
worker's adapter manager (worker/lora.py) as adapters come and go. A packed layer (q/k/v,
gate/up) keeps each packed projection's A stacked ([slots, packed * rank, in]) and its B, stored
transposed, as its own output columns of [slots, rank, out] (`bounds`: each projection's
columns), so that one pass over A serves every projection and B costs its own outputs, not a
block-diagonal matrix; the scaling is folded into B. A rank below the slot width is
zero-padded. One call per layer (csrc/lora.h, lora_apply) groups the step's tokens by slot: a
few tokens of one adapter read its A and B once for all of them, more run two GEMMs; the fused
decode stack calls the same function. Under tensor parallelism A and B shard with their layer:
a column-parallel layer keeps its rows of B, a row-parallel one its columns of A, whose partial
delta is summed with the partial output.

Each token's slot (`LoRAStep`) reaches the layers through the forward context, as the
attention plan does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from octavo.kernels import fused
from octavo.model.layers.linear import Linear
from octavo.model.layers.moe import FusedMoE


@dataclass
class LoRAStep:
    """Which adapter each token of a step runs: its slot, -1 for the base model. `sample_slot`:
    the same for the rows the LM head computes (the sampled positions), None where they are the
    step's tokens."""

    token_slot: torch.Tensor  # [T] int64
    slot_of: dict[int, int]  # adapter id -> its slot
    # the step's slots, sorted: every adapted layer reads them; None: every slot, over every
    # row in fixed shapes, nothing read on the host (a CUDA graph's step: worker/decode_graphs)
    slots: list[int] | None
    sample_slot: torch.Tensor | None = None


class LoRASlots:
    """The adapters' A and B of one linear layer (or the LM head, or the embedding)."""

    def __init__(self, bounds: list[int], in_features: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, embedding: bool = False) -> None:
        """bounds: the output rows of each packed projection, [0, ..., out] (one: [0, out])."""
        width = (len(bounds) - 1) * max_rank
        self.max_rank = max_rank
        self.bounds = bounds
        self.embedding = embedding
        # The embedding's A is looked up by token id: [slots, vocab, rank].
        self.a = torch.zeros((num_slots, in_features, width) if embedding else
                             (num_slots, width, in_features), dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, bounds[-1], dtype=dtype, device=device)  # B^T
        self.used = [False] * num_slots  # the slot's adapter targets this layer
        self.used_mask = torch.zeros(num_slots, dtype=torch.bool)  # the same, for the C++ stack

    def clear(self, slot: int) -> None:
        if self.used[slot]:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.used[slot] = False
            self.used_mask[slot] = False

    def set(self, slot: int, index: int, rows: tuple[int, int], a: torch.Tensor,
            b: torch.Tensor) -> None:
        """Packed slot `index`'s pair: a [rank, in] (already this rank's columns), b (scaled,
        this rank's rows) into output rows [rows[0], rows[1])."""
        rank = a.shape[0]
        cols = slice(index * self.max_rank, index * self.max_rank + rank)
        if self.embedding:
            self.a[slot][:, cols] = a.t()
        else:
            self.a[slot][cols] = a
        self.b[slot][:rank, rows[0]:rows[1]] = b.t()
        self.used[slot] = True
        self.used_mask[slot] = True

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, token_slot: torch.Tensor,
                  slots: list[int]) -> torch.Tensor:
        """y plus each row's adapter delta of x (token ids for the embedding); token_slot: each
        row's slot (-1: none), slots: those in the step (None: see LoRAStep)."""
        if slots is None:
            return self._masked_delta(x, y, token_slot)
        if not any(self.used[s] for s in slots):
            return y
        if not self.embedding and fused.native_active(x) and x.dtype == self.a.dtype \
                and y.stride(-1) == 1 and x.stride(-1) == 1:
            fused.native_module().lora_apply(y, x, self.a, self.b, self.bounds, self.used_mask,
                                             token_slot)
            return y
        for slot in slots:
            if not self.used[slot]:
                continue
            rows = torch.nonzero(token_slot == slot).flatten()
            xs = x.index_select(0, rows)
            t = F.embedding(xs, self.a[slot]) if self.embedding else xs @ self.a[slot].t()
            for j in range(len(self.bounds) - 1):  # csrc/lora.h's GEMMs
                first, end = self.bounds[j], self.bounds[j + 1]
                delta = t[:, j * self.max_rank:(j + 1) * self.max_rank] @ self.b[slot][
                    :, first:end]
                y[:, first:end].index_add_(0, rows, delta)
        return y

    def _masked_delta(self, x: torch.Tensor, y: torch.Tensor,
                      token_slot: torch.Tensor) -> torch.Tensor:
        """add_delta over every slot and row, each row's product zeroed but in its own slot
        (an empty slot holds zeros): no row count or slot list read on the host."""
        for slot in range(self.a.shape[0]):
            t = F.embedding(x, self.a[slot]) if self.embedding else x @ self.a[slot].t()
            t = t * (token_slot == slot).unsqueeze(1).to(t.dtype)
            for j in range(len(self.bounds) - 1):
                first, end = self.bounds[j], self.bounds[j + 1]
                y[:, first:end] += t[:, j * self.max_rank:(j + 1) * self.max_rank] @ self.b[
                    slot][:, first:end]
        return y


def linear_slots(layer: Linear, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRASlots:
    bounds = [0]
    for width in layer.shards:
        bounds.append(bounds[-1] + width)
    return LoRASlots(bounds, layer.in_features, num_slots, max_rank, dtype, device)


def set_linear_pair(layer: Linear, slots: LoRASlots, slot: int, index: int | None,
                    a: torch.Tensor, b: torch.Tensor) -> None:
    """Checkpoint-shaped A [rank, in] and scaled B [out, rank] of packed slot `index` (None:
    the whole layer) into `slot`, cut to this rank's share as the layer cut its weight. A pair
    over a fused checkpoint tensor of a packed layer (Phi-3's qkv_proj and gate_up_proj) is
    each packed projection's: its A serves all, B's rows split as the fused weight's are."""
    if index is None and len(layer.shards) > 1:
        widths = [s.full for s in layer.slot_spans] if layer.slot_spans else layer.shards
        if b.shape[0] != sum(widths):
            raise ValueError(f"LoRA pair of B {tuple(b.shape)} for a fused layer of "
                             f"{sum(widths)} outputs")
        start = 0
        for i, width in enumerate(widths):
            set_linear_pair(layer, slots, slot, i, a, b[start:start + width])
            start += width
        return
    index = 0 if index is None else index
    if layer.input_span is not None:
        a = layer.input_span.take(a, 1, "lora_A")
    if layer.slot_spans is not None:
        b = layer.slot_spans[index].take(b, 0, "lora_B")
    start = sum(layer.shards[:index])
    if b.shape[0] != layer.shards[index] or a.shape[1] != layer.in_features:
        raise ValueError(f"LoRA pair of shapes A {tuple(a.shape)}, B {tuple(b.shape)} for a "
                         f"layer slot of (out, in) ({layer.shards[index]}, {layer.in_features})")
    slots.set(slot, index, (start, start + b.shape[0]), a, b)



def expert_slots(moe: FusedMoE, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> list[tuple[LoRASlots, LoRASlots]]:
    """Each held expert's slots: its gate_up (gate and up packed, this rank's share of the
    intermediate width) and its down projection, as a linear layer's."""
    hidden, width = moe.hidden_size, moe.intermediate_size
    return [(LoRASlots([0, width, 2 * width], hidden, num_slots, max_rank, dtype, device),
             LoRASlots([0, hidden], width, num_slots, max_rank, dtype, device))
            for _ in range(moe.num_local)]


def set_expert_pair(moe: FusedMoE, slots: LoRASlots, slot: int, index: int | None,
                    a: torch.Tensor, b: torch.Tensor) -> None:
    """One expert's A [rank, in] and scaled B [out, rank] of its gate (index 0), up (1) or
    down (None) projection into `slot`, cut to this rank's share as FusedMoE cut the weights:
    gate and up keep their rows of B, down its columns of A."""
    width = moe.intermediate_size
    if index is None:
        a = moe.span.take(a, 1, "lora_A")
        rows = (0, moe.hidden_size)
    else:
        b = moe.span.take(b, 0, "lora_B")
        rows = (index * width, (index + 1) * width)
    if b.shape[0] != rows[1] - rows[0] or a.shape[1] != slots.a.shape[2]:
        raise ValueError(f"expert LoRA pair of shapes A {tuple(a.shape)}, B {tuple(b.shape)} "
                         f"for a projection of (out, in) ({rows[1] - rows[0]}, "
                         f"{slots.a.shape[2]})")
    slots.set(slot, 0 if index is None else index, rows, a, b)
