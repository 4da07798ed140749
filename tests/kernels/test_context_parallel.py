"""Context parallelism's attention, the ranks of a group played in one process: each rank's share of
a mixed step (decodes, a prefill chunk over cached context, a fresh prompt), its partial attention
over the keys it holds, and the combination by log-sum-exp, against attention computed directly
over every request's whole context (float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.kernels.context_parallel import (ContextParallel, build_step, combine,
                                             partial_attention)
from octavo.kernels.fused import write_kv
from octavo.kernels.paged_attention import step_layout

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
# (tokens already cached, tokens this step) per request
REQUESTS = [(37, 1), (0, 29), (11, 1), (50, 17), (0, 1), (6, 3)]


def _owner(pos: int, size: int) -> int:
    return (pos // BLOCK) % size


def _world(kv_ranks: int, gen: torch.Generator):
    """Every request's keys and values, its block table (core blocks of BLOCK * kv_ranks
    tokens) and the step's layout."""
    span = BLOCK * kv_ranks
    cached = np.array([c for c, _ in REQUESTS])
    new = np.array([n for _, n in REQUESTS])
    seq = cached + new
    blocks = -(-seq // span)
    ids = torch.randperm(int(blocks.sum()) + 3, generator=gen).numpy()
    tables = np.zeros((len(REQUESTS), int(blocks.max())), np.int64)
    offset = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = ids[offset:offset + n]
        offset += n
    keys = [torch.randn(int(s), KV_HEADS, DIM, generator=gen) for s in seq]
    values = [torch.randn(int(s), KV_HEADS, DIM, generator=gen) for s in seq]
    queries = [torch.randn(int(n), HEADS, DIM, generator=gen) for n in new]
    return tables, keys, values, queries, step_layout(new, seq), int(ids.max()) + 1


def _expected(keys, values, queries, scale, softcap, window) -> torch.Tensor:
    rows = []
    for r, (cached, new) in enumerate(REQUESTS):
        k = keys[r].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [L, H, D]
        v = values[r].double().repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("qhd,khd->hqk", queries[r].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(cached, cached + new)[:, None]
        k_pos = torch.arange(cached + new)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        s = s.masked_fill(~allowed, float("-inf"))
        rows.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(rows)


@pytest.mark.parametrize("split_tokens,shard_kv,size", [(False, True, 2), (True, False, 2),
                                                        (True, True, 2), (True, True, 3)])
@pytest.mark.parametrize("softcap,window", [(None, None), (5.0, 9), (None, 9)])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpp"])
def test_ranks_combine_to_full_attention(request, split_tokens, shard_kv, size, softcap, window,
                                         kernel):
    """With the C++ kernel, it takes the decodes and short queries (no window over a sharded
    cache, as step_context decides)."""
    if kernel:
        request.getfixturevalue("native_kernels")
    kernel = kernel and not (shard_kv and window is not None)
    gen = torch.Generator().manual_seed(size * 10 + split_tokens * 2 + shard_kv)
    kv_ranks = size if shard_kv else 1
    tables, keys, values, queries, layout, num_blocks = _world(kv_ranks, gen)
    scale = DIM ** -0.5
    q_all = torch.cat(queries)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(keys, REQUESTS)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(values, REQUESTS)])
    outs, lses, rows = [], [], []
    for rank in range(size):
        cp = ContextParallel(size, rank, split_tokens, shard_kv, BLOCK)
        step = build_step(cp, layout, tables, kernel=kernel)
        assert (step.kernel is not None) == kernel
        cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, DIM)
        # the context cached before the step, where the layout says this rank keeps it
        for r, (cached, _) in enumerate(REQUESTS):
            for p in range(cached):
                if _owner(p, kv_ranks) == rank % kv_ranks:
                    slot = tables[r, p // (BLOCK * kv_ranks)] * BLOCK + p % BLOCK
                    cache[0].view(-1, KV_HEADS, DIM)[slot] = keys[r][p]
                    cache[1].view(-1, KV_HEADS, DIM)[slot] = values[r][p]
        write_kv(cache, k_new[step.write_index], v_new[step.write_index], step.write_slots)
        out, lse = partial_attention(q_all[step.query_start:step.query_end], cache, step, scale,
                                     softcap, window)
        outs.append(out)
        lses.append(lse)
        rows.append((step.own_start, step.own_end))
    expected = _expected(keys, values, queries, scale, softcap, window)
    if shard_kv:  # every rank attended every query to its share of the keys
        got = combine(torch.stack(outs), torch.stack(lses))
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    else:  # every rank holds every key and answered its own tokens
        assert sorted(rows)[0][0] == 0 and rows[-1][1] == layout.num_tokens
        for (start, end), out in zip(rows, outs):
            torch.testing.assert_close(out.double(), expected[start:end], atol=1e-5, rtol=1e-5)


def test_decode_context_parallel_keeps_half_of_each_request_per_rank():
    """A 4,000-token request over two ranks: each keeps 2,000 of its positions, in whole blocks
    of 16 taken in turn, and together they keep every position once."""
    block, size, length = 16, 2, 4000
    layout = step_layout(np.array([length]), np.array([length]))
    tables = np.arange(-(-length // (block * size)))[None]
    kept = []
    for rank in range(size):
        step = build_step(ContextParallel(size, rank, True, True, block), layout, tables)
        positions = layout.positions[step.write_index.numpy()]
        assert len(positions) == length // size
        assert set(positions // block % size) == {rank}
        assert len(set(step.write_slots.tolist())) == len(positions)
        kept.append(positions)
    assert sorted(np.concatenate(kept).tolist()) == list(range(length))


def test_only_steps_with_a_prompt_chunk_are_split():
    decodes = step_layout(np.array([1, 1, 1]), np.array([40, 7, 90]))
    mixed = step_layout(np.array([1, 30]), np.array([40, 30]))
    tables = np.arange(36).reshape(3, 12)
    cp = ContextParallel(2, 1, True, True, BLOCK)
    assert not cp.splits(decodes) and cp.splits(mixed)
    assert not ContextParallel(2, 1, False, True, BLOCK).splits(mixed)
    step = build_step(cp, decodes, tables)  # every rank computes the three decodes
    assert (step.split, step.own_start, step.own_end, step.chunk) == (False, 0, 3, 3)
    step = build_step(cp, mixed, tables[:2])  # 31 tokens: rank 1 computes the last 15
    assert (step.split, step.own_start, step.own_end, step.chunk) == (True, 16, 31, 16)
