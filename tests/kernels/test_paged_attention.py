"""Paged attention of a mixed batch against dense per-request attention."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.kernels import fused
from octavo.kernels.fused import write_kv
from octavo.kernels.paged_attention import build_plan, paged_attention, step_layout


def _dense(q, k, v, start, scale, window=None, softcap=None):
    """q: [Q, H, D] for positions start..start+Q-1; k, v: [L, KVH, D] for positions 0..L-1."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, 1)
    v = v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    kpos = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("dim", [8, 64, 128])  # the C++ kernel specializes 64, 128 and 256
def test_mixed_batch_matches_dense(block_size, window, softcap, dim, native, native_kernels):
    fused.enable_native(native)
    rng = np.random.default_rng(block_size)
    heads, kv_heads = 6, 2
    # (already computed, computed now): decodes, fresh prefills, later chunks, block edges,
    # short queries over a context (speculative verification: the kernel takes their tokens).
    reqs = [(0, 1), (7, 1), (block_size, 1), (0, 9), (block_size - 1, 2 * block_size + 1),
            (3 * block_size, block_size), (0, block_size), (5, 3), (2 * block_size + 3, 5)]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    perm = rng.permutation(num_blocks)  # scattered, non-contiguous blocks
    tables, used, full_k, full_v = [], 0, [], []
    for done, new in reqs:
        need = -(-(done + new) // block_size)
        tables.append(perm[used:used + need])
        used += need
    max_blocks = max(len(t) for t in tables)
    table = np.zeros((len(reqs), max_blocks), np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    # Fill the already-computed context through the same slot arithmetic.
    for i, (done, new) in enumerate(reqs):
        k = torch.randn(done + new, kv_heads, dim)
        v = torch.randn(done + new, kv_heads, dim)
        full_k.append(k)
        full_v.append(v)
        if done:
            ctx = build_plan(step_layout(np.array([done]), np.array([done])), table[i:i + 1],
                             block_size)
            write_kv(cache, k[:done], v[:done], ctx.slot_mapping)
    query_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([d + n for d, n in reqs])
    plan = build_plan(step_layout(query_lens, seq_lens), table, block_size, window,
                      native_decode=native)
    assert (plan.decode is not None) == native
    q_all = [torch.randn(n, heads, dim) for _, n in reqs]
    write_kv(cache, torch.cat([k[d:] for k, (d, _) in zip(full_k, reqs)]),
             torch.cat([v[d:] for v, (d, _) in zip(full_v, reqs)]), plan.slot_mapping)
    out = paged_attention(torch.cat(q_all), cache, plan, dim ** -0.5, softcap)
    ref = torch.cat([_dense(q, k, v, d, dim ** -0.5, window, softcap)
                     for q, k, v, (d, _) in zip(q_all, full_k, full_v, reqs)])
    assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_a_windowed_plan_shares_the_steps_and_equals_one_built_with_the_window(native):
    """The sliding-window layers' plan is the step's plan with the window applied: the same
    slot and kernel tensors (built once a step), groups and masks as build_plan makes them."""
    from octavo.kernels.paged_attention import windowed_plan

    layout = step_layout(np.array([1, 40, 1200, 3]), np.array([90, 40, 1200, 70]))
    table = np.arange(4 * 80).reshape(4, 80)
    plan = build_plan(layout, table, 16, native_decode=native)
    derived = windowed_plan(plan, layout, table, 16, 32)
    built = build_plan(layout, table, 16, 32, native_decode=native)
    assert derived.slot_mapping is plan.slot_mapping
    assert torch.equal(derived.slot_mapping, built.slot_mapping)
    assert (derived.decode is None) == (built.decode is None) == (not native)
    if native:
        assert derived.decode.token_index is plan.decode.token_index
        assert derived.decode.window == built.decode.window == 32
        assert plan.decode.window is None
    assert len(derived.groups) == len(built.groups) >= 1
    for a, b in zip(derived.groups, built.groups):
        for name in ("token_index", "token_valid", "key_slots", "mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), name


def test_prefills_are_bucketed_by_length():
    """Short prompts are not padded to long ones; a lone fresh prompt runs causal, unmasked."""
    query_lens = np.array([32, 500, 40, 480, 1, 1])
    seq_lens = np.array([32, 500, 40, 480, 70, 90])
    table = np.arange(6 * 32).reshape(6, 32)
    # without the kernel: SDPA for all
    plan = build_plan(step_layout(query_lens, seq_lens), table, 16)
    sizes = sorted(tuple(sorted(g.token_valid.sum(1).tolist())) for g in plan.groups)
    assert sizes == [(1, 1), (32, 40), (480, 500)]
    # decodes too: one of 480 tokens of context is not the others' length
    decodes = build_plan(step_layout(np.ones(4, np.int64), np.array([70, 480, 90, 60])), table,
                         16)
    assert sorted(g.key_slots.shape[1] for g in decodes.groups) == [90, 480]
    alone = build_plan(step_layout(np.array([100]), np.array([100])), table[:1], 16)
    assert len(alone.groups) == 1 and alone.groups[0].mask is None
    # With the kernel, prompts up to KERNEL_CONTEXT_LEN tokens of context go to it; longer
    # ones to SDPA.
    long_table = np.arange(2 * 80).reshape(2, 80)
    mixed = build_plan(step_layout(np.array([1200, 300]), np.array([1200, 300])), long_table, 16,
                       native_decode=True)
    assert len(mixed.decode.token_index) == 300
    assert [g.token_valid.sum().item() for g in mixed.groups] == [1200]
    # Where the kernel computes prompts 16 tokens at a time, it takes them all.
    runs = build_plan(step_layout(np.array([1200, 300]), np.array([1200, 300])), long_table, 16,
                      native_decode=True, prompt_runs=True)
    assert len(runs.decode.token_index) == 1500 and not runs.groups


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 64), (4, 1, 256), (2, 2, 128)])
@pytest.mark.parametrize("window, softcap", [(None, None), (21, None), (None, 30.0)])
def test_prompt_runs_match_dense_bf16(block_size, heads, kv_heads, dim, window, softcap,
                                      native_kernels):
    """bf16 prompts through the C++ kernel, whose runs of 16+ tokens of one request are computed
    16 queries at a time: fresh prompts with partial tiles, a later chunk, a run just short of
    16, decodes between them, a request whose positions follow the previous request's in
    blocks of its own (two runs), and one that shares its first blocks with the one before it
    (its tokens continue that run: the same blocks)."""
    fused.enable_native(True)
    torch.manual_seed(block_size + dim)
    shared = 2 * block_size if block_size > 1 else 32  # positions in full blocks
    # (already computed, computed now, shares the previous request's blocks)
    reqs = [(0, 20), (20, 20), (40, 1), (0, 17), (37, 33), (0, 15), (5, 100), (0, shared),
            (shared, 20, True), (3, 1), (0, 70)]
    num_blocks = 160 if block_size > 1 else 600
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=torch.bfloat16)
    perm = np.random.default_rng(dim).permutation(num_blocks)
    tables, used, full_k, full_v = [], 0, [], []
    for i, (done, new, *share) in enumerate(reqs):
        own = list(tables[i - 1][:shared // block_size]) if share else []
        need = -(-(done + new) // block_size) - len(own)
        tables.append(np.array(own + list(perm[used:used + need])))
        used += need
        assert used <= num_blocks
        k = torch.randn(done + new, kv_heads, dim).bfloat16()
        v = torch.randn(done + new, kv_heads, dim).bfloat16()
        if share:  # the shared positions hold the previous request's K and V, written already
            k[:shared], v[:shared] = full_k[-1][:shared], full_v[-1][:shared]
        elif done:
            ctx = build_plan(step_layout(np.array([done]), np.array([done])), tables[i][None],
                             block_size)
            write_kv(cache, k[:done], v[:done], ctx.slot_mapping)
        full_k.append(k)
        full_v.append(v)
    table = np.zeros((len(reqs), max(len(t) for t in tables)), np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    query_lens = np.array([r[1] for r in reqs])
    seq_lens = np.array([r[0] + r[1] for r in reqs])
    plan = build_plan(step_layout(query_lens, seq_lens), table, block_size, window,
                      native_decode=True, prompt_runs=True)
    assert not plan.groups  # every token in the kernel
    write_kv(cache, torch.cat([k[r[0]:] for k, r in zip(full_k, reqs)]),
             torch.cat([v[r[0]:] for v, r in zip(full_v, reqs)]), plan.slot_mapping)
    q_all = [torch.randn(r[1], heads, dim).bfloat16() * 2 for r in reqs]
    out = paged_attention(torch.cat(q_all), cache, plan, dim ** -0.5, softcap)
    ref = torch.cat([_dense(q, k, v, r[0], dim ** -0.5, window, softcap)
                     for q, k, v, r in zip(q_all, full_k, full_v, reqs)])
    err = (out.double() - ref).abs()
    assert err.max() < 2e-2 and err.mean() < 2e-3  # bf16 outputs: half an ulp at |x| < 4
