"""Attention of a mixed batch (prefill chunks and decodes) over the paged KV cache, in torch.

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; token slot
`s = block_id * block_size + offset`. Requests are grouped into decodes (one query token) and
prefills (several); each group is padded to its longest query and context and run through one
`scaled_dot_product_attention` call. Both are bucketed by length first, so that padding
never costs more than a third of a bucket's work: a lone fresh prompt runs with `is_causal`
(no mask, and the kernel skips the blocks above the diagonal), a 32-token prompt is not
padded to a 512-token one (that padding made attention a quarter of a mixed workload's time),
and 60 decodes of 300 tokens of context are not padded to one of 2,000 (on a GPU, where every
decode takes this path, that padding gathered about 7 times the keys they need).
With the C++ kernels loaded, decodes skip the padding: one call reads each request's keys in
place from its blocks.
So do short queries (speculative verification, a prompt's last few tokens) and prompts of up to
KERNEL_CONTEXT_LEN tokens: the kernel takes each of their tokens as a query of its own over the
context up to and including it. Where it computes a prompt's tokens 16 at a time
(`fused.prompt_runs_ready`: bf16), it takes prompts of every length.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from octavo.kernels import fused

SMALL_GROUP = 4  # requests; below this the matmul path computes in fp32
# The in-place kernel takes each new token of a request as its own query when the request brings
# at most KERNEL_QUERY_LEN new tokens or has at most KERNEL_CONTEXT_LEN tokens of context; longer
# prefills share their key reads in SDPA calls instead, which win beyond about 1,500 tokens of
# context. Measured (bf16, 2 threads, 9 heads over 3 KV heads of 64): one 272-token prompt 0.84 ms
# in the kernel vs 1.54 ms in SDPA, 512: 3.0 vs 5.4, 1024: 12.2 vs 15.2, 2000: 47.5 vs 44.2;
# 8 prompts of 64: 0.31 vs 1.78. Computed 16 query tokens at a time (bf16), a prompt takes 0.46 ms
# at 272 tokens, 1.46 at 512, 5.6 at 1024 (SDPA 12.6) and 21.4 at 2000 (SDPA 38.5).
KERNEL_QUERY_LEN = 8
KERNEL_CONTEXT_LEN = 1024
# A prefill bucket's padded work (requests x longest query x longest context) stays within this
# factor of its real work.
PADDING_SLACK = 1.5


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [R, Qmax] index into the flat query tokens; T = padding
    token_valid: torch.Tensor | None  # [R, Qmax] bool; None: every entry is a token (a
    # captured decode step's fixed shapes, worker/decode_graphs.py)
    key_slots: torch.Tensor  # [R, Lmax] cache slot of each context position (0 for padding)
    mask: torch.Tensor | None  # [R, 1, Qmax, Lmax] bool, True = attend; None: one request
    # whose queries are its whole context (a fresh prompt), causal from the top left


@dataclass
class DecodeGroup:
    """Queries for the in-place kernel (no padding, no gathered copies): one entry per query
    token, which attends to its request's context up to and including itself."""

    token_index: torch.Tensor  # [Q] position of each query in the flat tokens
    block_table: torch.Tensor  # [Q, max_blocks] its request's blocks
    seq_lens: torch.Tensor  # [Q] context length through the query token
    window: int | None


@dataclass
class AttentionPlan:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    groups: list[AttentionGroup]
    decode: DecodeGroup | None = None
    buckets: list[np.ndarray] = field(default_factory=list)  # each group's requests


@dataclass(frozen=True)
class StepLayout:
    """A step's tokens laid out request after request: request r brings query_lens[r] new
    tokens, which end its context of seq_lens[r]. Flattened once per step (step_layout) and
    read by the runner (input ids, positions, the tokens it samples), the attention plans and
    the drafter."""

    query_lens: np.ndarray  # [R]
    seq_lens: np.ndarray  # [R]
    starts: np.ndarray  # [R] the index of each request's first token
    ends: np.ndarray  # [R] one past its last
    req_of_token: np.ndarray  # [T]
    positions: np.ndarray  # [T] each token's position in its request

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


def step_layout(query_lens: np.ndarray, seq_lens: np.ndarray) -> StepLayout:
    ends = np.cumsum(query_lens)
    starts = ends - query_lens
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = ((seq_lens - query_lens)[req_of_token] + np.arange(len(req_of_token))
                 - starts[req_of_token])
    return StepLayout(query_lens, seq_lens, starts, ends, req_of_token, positions)


def build_plan(layout: StepLayout, block_table: np.ndarray, block_size: int,
               sliding_window: int | None = None, device: torch.device | str = "cpu",
               native_decode: bool = False, prompt_runs: bool = False) -> AttentionPlan:
    """Index tensors for one step, shared by every layer.

    layout: the step's tokens (step_layout); block_table[r]: request r's block ids (padded).
    native_decode: the tokens of requests with at most KERNEL_QUERY_LEN new tokens or at most
    KERNEL_CONTEXT_LEN tokens of context go to the C++ kernel (`fused.decode_attention`);
    with prompt_runs too (the kernel computes prompts 16 tokens at a time), every token does.
    """
    query_lens, seq_lens, req_of_token, pos = (layout.query_lens, layout.seq_lens,
                                               layout.req_of_token, layout.positions)
    slots = block_table[req_of_token, pos // block_size] * block_size + pos % block_size
    decode = None
    in_padded = np.arange(len(query_lens))  # the requests the padded groups take
    if native_decode:
        if prompt_runs:  # the kernel takes every token
            token_index, in_padded = np.arange(layout.num_tokens), in_padded[:0]
        else:
            short = (query_lens <= KERNEL_QUERY_LEN) | (seq_lens <= KERNEL_CONTEXT_LEN)
            token_index, in_padded = np.flatnonzero(short[req_of_token]), np.flatnonzero(~short)
        if len(token_index):
            kernel_lens = (pos[token_index] + 1).astype(np.int64, copy=False)
            used_blocks = -(-int(kernel_lens.max()) // block_size)
            decode = DecodeGroup(
                torch.from_numpy(token_index).to(device),
                torch.from_numpy(np.ascontiguousarray(
                    block_table[req_of_token[token_index], :used_blocks], np.int64)).to(device),
                torch.from_numpy(kernel_lens).to(device), sliding_window)
    buckets = []
    if len(in_padded):  # decodes (none once the kernel takes them), then prefills
        single = query_lens[in_padded] == 1
        buckets = (_length_buckets(in_padded[single], query_lens, seq_lens)
                   + _length_buckets(in_padded[~single], query_lens, seq_lens))
    plan = AttentionPlan(layout.num_tokens,
                         torch.from_numpy(slots.astype(np.int64, copy=False)).to(device),
                         [], decode, buckets)
    plan.groups = _groups(plan, layout, block_table, block_size, sliding_window, device)
    return plan


def windowed_plan(plan: AttentionPlan, layout: StepLayout, block_table: np.ndarray,
                  block_size: int, window: int, device: torch.device | str = "cpu"
                  ) -> AttentionPlan:
    """The step's plan for layers with a sliding window: the same slots, kernel entries and
    buckets as `plan` (built for the same step without a window), the window applied."""
    decode = None if plan.decode is None else replace(plan.decode, window=window)
    windowed = AttentionPlan(plan.num_tokens, plan.slot_mapping, [], decode, plan.buckets)
    windowed.groups = _groups(windowed, layout, block_table, block_size, window, device)
    return windowed


def check_chunk(chunk: int | None, block_size: int) -> None:
    """NotImplementedError where a model's attention chunk is not whole KV blocks, which
    chunked_plan needs; its runners call this at start-up."""
    if chunk is not None and chunk % block_size:
        raise NotImplementedError(f"attention_chunk_size {chunk} is not a multiple of the KV "
                                  f"block size {block_size} (--block-size)")


def chunked_plan(plan: AttentionPlan, layout: StepLayout, block_table: np.ndarray,
                 block_size: int, chunk: int, device: torch.device | str = "cpu"
                 ) -> AttentionPlan:
    """The step's plan for layers with chunked local attention (Llama 4): a query at position
    p sees the keys from p - p % chunk through p. The same slots and buckets as `plan`; each
    kernel entry reads its chunk as a context of its own (its table from the chunk's first
    block, its length counted from there), which needs `chunk` to be whole blocks
    (check_chunk)."""
    decode = None
    if plan.decode is not None:
        index = plan.decode.token_index.cpu().numpy()
        pos = layout.positions[index]
        first = pos - pos % chunk
        lens = (pos + 1 - first).astype(np.int64)
        cols = (first // block_size)[:, None] + np.arange(-(-int(lens.max()) // block_size))
        tables = block_table[layout.req_of_token[index][:, None],
                             np.minimum(cols, block_table.shape[1] - 1)]
        decode = DecodeGroup(plan.decode.token_index, torch.from_numpy(
            np.ascontiguousarray(tables, np.int64)).to(device), torch.from_numpy(lens).to(device),
            None)
    chunked = AttentionPlan(plan.num_tokens, plan.slot_mapping, [], decode, plan.buckets)
    chunked.groups = _groups(chunked, layout, block_table, block_size, None, device, chunk)
    return chunked


def _groups(plan: AttentionPlan, layout: StepLayout, block_table: np.ndarray, block_size: int,
            window: int | None, device: torch.device | str,
            chunk: int | None = None) -> list[AttentionGroup]:
    return [_group(members, layout.query_lens, layout.seq_lens, layout.starts, block_table,
                   block_size, plan.num_tokens, window, device, chunk)
            for members in plan.buckets]


def _length_buckets(members: np.ndarray, query_lens: np.ndarray,
                    seq_lens: np.ndarray) -> list[np.ndarray]:
    """Requests sorted by context length, cut into runs whose padded work stays within
    PADDING_SLACK of the real work (one SDPA call per run)."""
    order = members[np.argsort(seq_lens[members], kind="stable")]
    buckets: list[np.ndarray] = []
    first, work, q_max = 0, 0, 0
    for i, r in enumerate(order):
        q, length = int(query_lens[r]), int(seq_lens[r])
        padded = (i - first + 1) * max(q_max, q) * length  # sorted: this one is the longest
        if i > first and padded > PADDING_SLACK * (work + q * length):
            buckets.append(order[first:i])
            first, work, q_max = i, 0, 0
        work += q * length
        q_max = max(q_max, q)
    if len(order):
        buckets.append(order[first:])
    return buckets


def _group(members: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, starts: np.ndarray,
           block_table: np.ndarray, block_size: int, num_tokens: int, window: int | None,
           device: torch.device | str, chunk: int | None = None) -> AttentionGroup:
    qlen, slen = query_lens[members], seq_lens[members]
    q_max, l_max = int(qlen.max()), int(slen.max())
    i = np.arange(q_max)
    valid = i[None, :] < qlen[:, None]
    token_index = np.where(valid, starts[members][:, None] + i[None, :], num_tokens)
    j = np.arange(l_max)
    key_slots = block_table[members][:, j // block_size] * block_size + j % block_size
    mask = None
    if len(members) > 1 or q_max != l_max or window is not None or chunk is not None:
        # Padded query rows get position 0 so they attend to one key and never produce NaN.
        q_pos = np.where(valid, (slen - qlen)[:, None] + i[None, :], 0)
        mask = j[None, None, :] <= q_pos[:, :, None]
        if window is not None:
            mask &= j[None, None, :] > q_pos[:, :, None] - window
        if chunk is not None:
            mask &= j[None, None, :] >= (q_pos - q_pos % chunk)[:, :, None]
        mask = torch.from_numpy(mask[:, None]).to(device)
    return AttentionGroup(
        torch.from_numpy(token_index.astype(np.int64)).to(device),
        torch.from_numpy(valid).to(device),
        torch.from_numpy(key_slots.astype(np.int64)).to(device), mask)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                    scale: float, softcap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim]. K/V must already be written.
    An fp8 cache holds k / k_scale and v / v_scale (one pair per layer): k_scale folds into the
    softmax scale, v_scale into the output. sinks: a learned logit per head that joins each
    softmax's denominator without a value (gpt-oss); the kernel's output o over keys of
    log-sum-exp L becomes o * sigmoid(L - sink)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, kvh, _ = kv_cache.shape
    out = torch.empty_like(q)
    if plan.decode is not None:
        d = plan.decode
        lse = (None if sinks is None else
               q.new_empty((num_tokens, num_heads), dtype=torch.float32))
        fused.decode_attention(out, q, kv_cache, d.token_index, d.block_table, d.seq_lens,
                               scale * k_scale, softcap, d.window, lse)
        if v_scale != 1.0:
            out[d.token_index] *= v_scale
        if sinks is not None:
            kept = torch.sigmoid(lse[d.token_index] - sinks.float()).unsqueeze(-1)
            out[d.token_index] = (out[d.token_index] * kept).to(out.dtype)
    if not plan.groups:
        return out
    q_padded = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])
    k_flat = kv_cache[0].view(-1, kvh, head_dim)
    v_flat = kv_cache[1].view(-1, kvh, head_dim)
    for g in plan.groups:
        qg = q_padded[g.token_index].transpose(1, 2)  # [R, H, Qmax, D]
        kg = _gather(k_flat, g.key_slots).to(q.dtype)  # [R, KVH, Lmax, D]
        vg = _gather(v_flat, g.key_slots).to(q.dtype)
        if k_scale != 1.0 or v_scale != 1.0:
            kg, vg = kg * k_scale, vg * v_scale
        if softcap is None and sinks is None and qg.shape[2] > 1:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                                is_causal=g.mask is None,
                                                enable_gqa=kvh != num_heads)
        else:
            mask = g.mask
            if mask is None:
                mask = torch.ones(qg.shape[2], kg.shape[2], dtype=torch.bool,
                                  device=q.device).tril()[None, None]
            og = _matmul_attention(qg, kg, vg, mask, scale, softcap, sinks)
        og = og.transpose(1, 2)  # [R, Qmax, H, D]
        if g.token_valid is None:  # (a boolean index would read its count on the host)
            out.index_copy_(0, g.token_index.reshape(-1), og.reshape(-1, num_heads, head_dim))
        else:
            out[g.token_index[g.token_valid]] = og[g.token_valid]
    return out


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat: [num_slots, KVH, D], slots: [R, L] -> [R, KVH, L, D] (a strided view of one copy).
    index_select on 2-D rows is several times faster than advanced indexing here."""
    r, length = slots.shape
    _, kvh, d = flat.shape
    rows = flat.view(-1, kvh * d).index_select(0, slots.reshape(-1))
    return rows.view(r, length, kvh, d).transpose(1, 2)


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain matmul attention. The query heads of a KV head are folded into the query axis, so
    GQA needs no copy of K/V. On the CPU this beats SDPA for single-token (decode) queries by
    about 10x in bf16."""
    r, h, q_len, d = q.shape
    out_dtype = q.dtype
    if r <= SMALL_GROUP and q.dtype == torch.bfloat16:
        # Tiny bf16 matmuls cost more in dispatch than fp32 ones (36 vs 22 µs for one request).
        q, k, v = q.float(), k.float(), v.float()
    kvh = k.shape[1]
    groups = h // kvh
    qf = q.reshape(r, kvh, groups * q_len, d)  # heads are contiguous per KV head
    scores = torch.matmul(qf, k.transpose(-1, -2)).float() * scale  # [R, KVH, G*Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(r, kvh, groups, q_len, -1).masked_fill(~mask.unsqueeze(1), float("-inf"))
    if sinks is not None:  # one more logit per head in each softmax, dropped after it
        sink = sinks.float().view(1, kvh, groups, 1, 1).expand(r, kvh, groups, q_len, 1)
        scores = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        scores = scores.softmax(-1)
    probs = scores.to(v.dtype).view(r, kvh, groups * q_len, -1)
    return torch.matmul(probs, v).view(r, h, q_len, d).to(out_dtype)
