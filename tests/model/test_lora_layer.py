"""A linear layer's adapter deltas (model/layers/lora.py) against the plain product in float64:
over dense and int4 weights, for a batch whose tokens mix adapters (consecutive and scattered
rows), and cut to a tensor-parallel rank's share as the layer's weight is."""
from __future__ import annotations

import pytest
import torch

from octavo.model.context import ForwardContext, forward_context
from octavo.model.layers.linear import Linear, Span
from octavo.model.layers.lora import LoRAStep, linear_slots, set_linear_pair
from octavo.model.quant.base import OnTheFlyMethod
from octavo.model.quant.packed import quantize_int4


def _layer(shards, in_features, weight, quantize, slot_spans=None, input_span=None):
    layer = Linear(in_features, shards, slot_spans=slot_spans, input_span=input_span)
    if quantize:
        layer.set_quant_method(OnTheFlyMethod(
            "int4", lambda w, dt: quantize_int4(w, 32, dt), torch.float32))
    layer.load_shard("weight", None, weight)
    layer.process_after_load()
    return layer


def _run(layer, x, token_slot):
    """layer(x) with row t running the adapter in slot token_slot[t] (-1: none)."""
    slots = sorted({s for s in token_slot if s >= 0})
    step = LoRAStep(torch.tensor(token_slot), {s + 1: s for s in slots}, slots)
    with forward_context(ForwardContext(None, [], lora=step)):
        return layer(x)


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "int4"])
def test_packed_layer_adds_each_tokens_adapter(quantize):
    torch.manual_seed(0)
    shards, k = [48, 16, 16], 64
    weight = torch.randn(sum(shards), k)
    layer = _layer(shards, k, weight, quantize)
    layer.lora = linear_slots(layer, num_slots=3, max_rank=8, dtype=torch.float32,
                              device=torch.device("cpu"))
    pairs = {}  # slot -> {packed index: (A, scaled B)}; slot 1 targets q and v only
    for slot, (rank, targeted) in {0: (8, [0, 1, 2]), 1: (4, [0, 2])}.items():
        pairs[slot] = {}
        for index in targeted:
            a, b = torch.randn(rank, k), torch.randn(shards[index], rank) * 0.3
            set_linear_pair(layer, layer.lora, slot, index, a, b)
            pairs[slot][index] = (a, b)
    x = torch.randn(7, k)
    token_slot = [0, 0, 0, -1, 1, -1, 1]  # tokens 3 and 5: the base model
    got = _run(layer, x, token_slot)
    base = _run(layer, x, [-1] * 7)
    want = base.double().clone()
    token_slots = {0: 0, 1: 0, 2: 0, 4: 1, 6: 1}
    for token, slot in token_slots.items():
        start = 0
        for index, width in enumerate(shards):
            if index in pairs[slot]:
                a, b = pairs[slot][index]
                want[token, start:start + width] += b.double() @ (a.double() @ x[token].double())
            start += width
    assert torch.allclose(got.double(), want, atol=1e-4)
    layer.lora.clear(1)  # an evicted adapter leaves nothing behind
    assert torch.allclose(_run(layer, x, token_slot)[4], base[4])


def test_pairs_shard_with_their_layer():
    """Rank 1 of 2: a column-parallel layer keeps its rows of B, a row-parallel one its columns
    of A; the row-parallel ranks' partial deltas add up to the whole layer's."""
    torch.manual_seed(1)
    k, n, rank = 64, 32, 4
    weight, a, b = torch.randn(n, k), torch.randn(rank, k), torch.randn(n, rank)
    x = torch.randn(3, k)
    whole = x @ weight.t() + (x @ a.t()) @ b.t()
    column = Linear(k, [n // 2], slot_spans=[Span(n // 2, n // 2, n)])
    column.load_shard("weight", None, weight)
    column.process_after_load()
    column.lora = linear_slots(column, 1, rank, torch.float32, torch.device("cpu"))
    set_linear_pair(column, column.lora, 0, None, a, b)
    assert torch.allclose(_run(column, x, [0, 0, 0]), whole[:, n // 2:], atol=1e-4)
    partial = torch.zeros(3, n)
    for r in range(2):
        row = Linear(k // 2, [n], input_span=Span(r * k // 2, k // 2, k), reduce=False)
        row.load_shard("weight", None, weight)
        row.process_after_load()
        row.lora = linear_slots(row, 1, rank, torch.float32, torch.device("cpu"))
        set_linear_pair(row, row.lora, 0, None, a, b)
        partial += _run(row, x[:, r * k // 2:(r + 1) * k // 2], [0, 0, 0])
    assert torch.allclose(partial, whole, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40], ids=["one", "few", "gemm"])
@pytest.mark.parametrize("bounds", [[0, 48, 64, 80], [0, 160, 224, 232]],
                         ids=["narrow", "blocks"])  # outputs below and above a register block
def test_native_deltas_match_float64(native_kernels, dtype, tokens, bounds):
    """csrc/lora.h (a few rows: one pass over A and B; many: two GEMMs) for tokens of two
    adapters interleaved with base-model tokens, against the deltas in float64."""
    from octavo.kernels import fused

    torch.manual_seed(2)
    k, rank, out = 64, 8, bounds[-1]
    a = (torch.randn(3, 3 * rank, k) * 0.3).to(dtype)  # three slots
    bt = (torch.randn(3, rank, out) * 0.3).to(dtype)
    used = torch.tensor([True, True, False])  # slot 2's adapter does not target this layer
    n = 3 * tokens
    token_slot = torch.tensor([[0, -1, 1, 2][t % 4] for t in range(n)])
    x = torch.randn(n, k).to(dtype)
    y = torch.randn(n, out).to(dtype)
    want = y.double().clone()
    for t, slot in enumerate(token_slot.tolist()):
        if slot in (0, 1):
            h = a[slot].double() @ x[t].double()
            for j in range(3):
                want[t, bounds[j]:bounds[j + 1]] += (
                    h[j * rank:(j + 1) * rank] @ bt[slot].double()[:, bounds[j]:bounds[j + 1]])
    fused.native_module().lora_apply(y, x, a, bt, bounds, used, token_slot)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 rounds its larger sums more
    assert torch.allclose(y.double(), want, atol=tol, rtol=rtol), (y.double() - want).abs().max()
