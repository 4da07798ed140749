"""Context parallelism's share of a step's attention: which tokens a rank computes, which keys
and values it keeps, and attention over its keys with each query's log-sum-exp, so that the
partial outputs of several ranks combine into the exact softmax.

A context-parallel group of C ranks runs every step together. Split tokens (prefill context
parallel): in a step with a prompt chunk (some request brings more than one token), rank r
computes the step's flat tokens [r * S, (r + 1) * S), S = ceil(T / C), padded to S rows; the
attention layers exchange the step's keys and values (and queries, with the cache sharded too).
A step of single-token decodes is not split: cutting a few tokens C ways saves less than the
exchange costs, so every rank computes all of them (with a whole cache on each rank, as one
process would: `splits` says when). Sharded KV (decode context parallel): position p of a
request lives on rank (p // B) % C, B the cache's block size, in the physical block
`table[p // (B * C)]` at offset p % B: the core's block of B * C tokens is one block on each
rank, so the core allocates and caches blocks as it always does and every rank holds a C-th of
every request's KV. Each rank
attends every query to the keys it holds; a query none of whose keys a rank holds gets a
log-sum-exp of -inf there and weighs nothing in the combination.

A query's keys on a rank are a prefix of the rank's keys in their order (those at positions up
to its own), so the in-place C++ kernel computes decodes and short queries as it does without
context parallelism, over the rank's blocks with the local count as the length, and returns
each query's log-sum-exp; longer prompt chunks go to PyTorch's fused attention in padded
groups. (A sliding window over a sharded cache is no prefix in local order: groups only.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from octavo.kernels import fused
from octavo.kernels.paged_attention import (KERNEL_CONTEXT_LEN, KERNEL_QUERY_LEN, StepLayout,
                                            _gather, _length_buckets)

# Scores of one slice of a group's queries at a time: at most this many elements (fp32).
SCORE_ELEMENTS = 1 << 24
# A step keeps its slices' attention biases for the next layers up to this many bytes (a long
# context's would otherwise hold the whole padded score matrix); beyond, each layer rebuilds them.
BIAS_CACHE_BYTES = 256 << 20
_FAR = np.iinfo(np.int64).max // 2  # the position of a padded key: after every query


@dataclass(frozen=True)
class ContextParallel:
    """A rank's place in its context-parallel group and what the group splits."""

    size: int
    rank: int
    split_tokens: bool  # --prefill-context-parallel-size
    shard_kv: bool  # --decode-context-parallel-size
    block_size: int  # tokens of a block of this rank's cache

    def splits(self, layout: StepLayout) -> bool:
        """Whether this step's tokens are split over the ranks: those with a prompt chunk."""
        return self.split_tokens and layout.num_tokens > len(layout.query_lens)

    @property
    def kv_ranks(self) -> int:
        return self.size if self.shard_kv else 1

    @property
    def kv_rank(self) -> int:
        return self.rank if self.shard_kv else 0


@dataclass
class ContextGroup:
    """Requests whose queries attend to this rank's keys in one padded batch."""

    token_index: torch.Tensor  # [R, Qmax] each query's row in the step's queries; padding = Q
    token_valid: torch.Tensor  # [R, Qmax]
    key_slots: torch.Tensor  # [R, Lmax] local cache slots (0 for padding)
    query_pos: torch.Tensor  # [R, Qmax] positions in the request
    key_pos: torch.Tensor  # [R, Lmax] (padding: after every query)
    # computed for the first layer, reused by the others: by sliding window (and query slice)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    biases: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """[R, 1, Qmax, Lmax], True = attend."""
        if window not in self.masks:
            q, k = self.query_pos[:, :, None], self.key_pos[:, None, :]
            allowed = k <= q
            if window is not None:
                allowed &= k > q - window
            self.masks[window] = allowed[:, None]
        return self.masks[window]

    def bias(self, window: int | None, lo: int, rows: int, groups: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [lo, lo + rows)'s mask as an additive fp32 bias, repeated for the `groups`
        query heads of a KV head ([R, 1, groups * rows, Lmax]), and whether each query has a
        key ([R, rows])."""
        key = (window, lo, rows, groups)
        if key in self.biases:
            return self.biases[key]
        allowed = self.mask(window)[:, :, lo:lo + rows]  # [R, 1, Q, L]
        r, _, q_len, length = allowed.shape
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        bias.masked_fill_(~allowed, float("-inf"))
        bias = bias[:, :, None].expand(r, 1, groups, q_len, length).reshape(
            r, 1, groups * q_len, length)
        made = bias, allowed[:, 0].any(-1)
        held = sum(b.numel() * 4 for b, _ in self.biases.values())
        if held + bias.numel() * 4 <= BIAS_CACHE_BYTES:
            self.biases[key] = made
        return made


@dataclass
class KernelQueries:
    """Queries for the in-place kernel, one entry each, over this rank's keys."""

    token_index: torch.Tensor  # [N] rows in the step's queries
    block_table: torch.Tensor  # [N, blocks] its request's core blocks (one block here each)
    seq_lens: torch.Tensor  # [N] how many of this rank's keys it attends to


@dataclass
class ContextParallelStep:
    cp: ContextParallel
    split: bool  # the step's tokens are split (cp.splits)
    num_tokens: int  # T, the step's tokens over the whole group
    chunk: int  # the rows this rank computes (its tokens, padded): T without split tokens
    own_start: int  # its tokens are the step's [own_start, own_end)
    own_end: int
    write_index: torch.Tensor  # [W] the step's tokens whose K/V this rank keeps
    write_slots: torch.Tensor  # [W] their slots in its cache
    query_start: int  # attention's queries are the step's tokens [query_start, query_end)
    query_end: int
    groups: list[ContextGroup]
    kernel: KernelQueries | None = None


def build_step(cp: ContextParallel, layout: StepLayout, tables: np.ndarray,
               device: torch.device | str = "cpu", kernel: bool = False) -> ContextParallelStep:
    """One step's share for this rank. tables[r]: request r's core block ids. kernel: the C++
    kernel takes decodes and short queries (it is loaded, and no window crosses a sharded
    cache)."""
    t = layout.num_tokens
    split = cp.splits(layout)
    if split:
        chunk = -(-t // cp.size)
        own_start = min(cp.rank * chunk, t)
        own_end = min(own_start + chunk, t)
    else:
        chunk, own_start, own_end = t, 0, t
    block, kv_ranks, kv_rank = cp.block_size, cp.kv_ranks, cp.kv_rank
    span = block * kv_ranks  # tokens of a core block
    pos, req = layout.positions, layout.req_of_token
    kept = np.flatnonzero((pos // block) % kv_ranks == kv_rank)
    slots = tables[req[kept], pos[kept] // span] * block + pos[kept] % block
    # A rank holding every key computes its own tokens' queries; one holding a share computes
    # every query against that share.
    q_start, q_end = (0, t) if cp.shard_kv else (own_start, own_end)
    first = np.clip(layout.starts, q_start, q_end)
    last = np.clip(layout.ends, q_start, q_end)
    num_queries = last - first
    # a request's keys run up to its last query; how many of them this rank holds
    context = layout.seq_lens - (layout.ends - last)
    local_lens = _held(context, block, span, kv_rank)
    members = np.flatnonzero((num_queries > 0) & (local_lens > 0))
    queries = None
    if kernel and len(members):
        short = ((num_queries[members] <= KERNEL_QUERY_LEN)
                 | (context[members] <= KERNEL_CONTEXT_LEN))
        queries = _kernel_queries(members[short], first, num_queries, q_start, layout, tables,
                                  block, span, kv_rank, device)
        members = members[~short]
    groups = [_group(bucket, first, q_start, q_end, num_queries, local_lens, layout, tables,
                     block, span, kv_rank, device)
              for bucket in (_length_buckets(members, num_queries, local_lens)
                             if len(members) else [])]
    return ContextParallelStep(
        cp, split, t, chunk, own_start, own_end, torch.from_numpy(kept).to(device),
        torch.from_numpy(slots.astype(np.int64, copy=False)).to(device), q_start, q_end, groups,
        queries)


def _held(length: np.ndarray, block: int, span: int, kv_rank: int) -> np.ndarray:
    """How many of a request's first `length` positions this rank keeps (blocks of `block`
    positions in turn, `span` = block x ranks)."""
    return (length // span) * block + np.clip(length % span - kv_rank * block, 0, block)


def _kernel_queries(members: np.ndarray, first: np.ndarray, num_queries: np.ndarray,
                    q_start: int, layout: StepLayout, tables: np.ndarray, block: int, span: int,
                    kv_rank: int, device: torch.device | str) -> KernelQueries | None:
    if not len(members):
        return None
    counts = num_queries[members]
    req = np.repeat(members, counts)
    tokens = np.repeat(first[members], counts) + (np.arange(int(counts.sum()))
                                                  - np.repeat(np.cumsum(counts) - counts, counts))
    keys = layout.positions[tokens] + 1  # a query's keys: the positions up to its own
    local = _held(keys, block, span, kv_rank)
    has = local > 0
    if not has.any():
        return None
    req, tokens, local = req[has], tokens[has], local[has]
    used = -(-int(local.max()) // block)
    return KernelQueries(torch.from_numpy(tokens - q_start).to(device),
                         torch.from_numpy(np.ascontiguousarray(tables[req, :used],
                                                               np.int64)).to(device),
                         torch.from_numpy(local.astype(np.int64)).to(device))


def _group(members: np.ndarray, first: np.ndarray, q_start: int, q_end: int,
           num_queries: np.ndarray, local_lens: np.ndarray, layout: StepLayout,
           tables: np.ndarray, block: int, span: int, kv_rank: int,
           device: torch.device | str) -> ContextGroup:
    """first[r]: the step's token of request r's first query here."""
    nq, nk = num_queries[members], local_lens[members]
    i, j = np.arange(int(nq.max())), np.arange(int(nk.max()))
    valid = i[None, :] < nq[:, None]
    tokens = np.minimum(first[members][:, None] + i[None, :], layout.num_tokens - 1)
    token_index = np.where(valid, tokens - q_start, q_end - q_start)
    query_pos = np.where(valid, layout.positions[tokens], 0)
    key_valid = j[None, :] < nk[:, None]
    key_pos = np.where(key_valid, (j // block) * span + kv_rank * block + j % block, _FAR)
    key_slots = np.where(key_valid, tables[members][:, j // block] * block + j % block, 0)
    return ContextGroup(*(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (
        token_index.astype(np.int64), valid, key_slots.astype(np.int64),
        query_pos.astype(np.int64), key_pos.astype(np.int64))))


def partial_attention(q: torch.Tensor, kv_cache: torch.Tensor, step: ContextParallelStep,
                      scale: float, softcap: float | None, window: int | None,
                      k_scale: float = 1.0, v_scale: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Q, H, D], the step's queries [query_start, query_end) -> their attention over this
    rank's keys, [Q, H, D] in fp32, and its log-sum-exp [Q, H] (-inf: no key here)."""
    num_queries, heads, dim = q.shape
    kvh = kv_cache.shape[3]
    out = q.new_zeros((num_queries, heads, dim), dtype=torch.float32)
    lse = q.new_full((num_queries, heads), float("-inf"), dtype=torch.float32)
    q_padded = torch.cat([q, q.new_zeros(1, heads, dim)]).float()
    if step.kernel is not None:
        e = step.kernel
        fused.decode_attention(out, q_padded[:num_queries], kv_cache, e.token_index,
                               e.block_table, e.seq_lens, scale * k_scale, softcap, window, lse)
        if v_scale != 1.0:
            out[e.token_index] *= v_scale
    k_flat = kv_cache[0].view(-1, kvh, dim)
    v_flat = kv_cache[1].view(-1, kvh, dim)
    for g in step.groups:
        kg = _gather(k_flat, g.key_slots).float()  # [R, KVH, L, D]
        vg = _gather(v_flat, g.key_slots).float()
        if k_scale != 1.0 or v_scale != 1.0:
            kg, vg = kg * k_scale, vg * v_scale
        r, q_max = g.token_index.shape
        rows = max(1, SCORE_ELEMENTS // max(1, r * heads * kg.shape[2]))
        for lo in range(0, q_max, rows):
            index = g.token_index[:, lo:lo + rows]
            if softcap is None and q.device.type == "cpu":
                bias, has_key = g.bias(window, lo, rows, heads // kvh)
                o, s = _flash(q_padded[index], kg, vg, bias, has_key, scale)
            else:
                o, s = _attend(q_padded[index], kg, vg, g.mask(window)[:, :, lo:lo + rows],
                               scale, softcap)
            valid = g.token_valid[:, lo:lo + rows]
            out[index[valid]] = o[valid]
            lse[index[valid]] = s[valid]
    return out, lse


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           has_key: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """_attend through PyTorch's fused CPU attention, which returns the log-sum-exp (4x faster
    than the matmuls at 256 queries over 4,000 keys). bias: [R, 1, G*Q, L] additive (-inf:
    masked), in the folded query order; has_key: [R, Q], whether a query has any key here (the
    kernel gives a query with none a log-sum-exp of 0)."""
    r, q_len, h, d = q.shape
    kvh = k.shape[1]
    qf = q.permute(0, 2, 1, 3).reshape(r, kvh, h // kvh * q_len, d)
    out, lse = _FLASH_CPU(qf, k, v, attn_mask=bias, scale=scale)
    out = out.reshape(r, h, q_len, d).transpose(1, 2)
    lse = lse.reshape(r, h, q_len).transpose(1, 2)
    none = ~has_key[:, :, None]
    return out.masked_fill(none[..., None], 0.0), lse.masked_fill(none, float("-inf"))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, Q, H, D] over k, v [R, KVH, L, D] -> out [R, Q, H, D], lse [R, Q, H]. The query
    heads of a KV head are folded into the query axis, so GQA needs no copy of K/V."""
    r, q_len, h, d = q.shape
    kvh = k.shape[1]
    groups = h // kvh
    qf = q.permute(0, 2, 1, 3).reshape(r, kvh, groups * q_len, d)
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [R, KVH, G*Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(r, kvh, groups, q_len, -1).masked_fill(~mask.unsqueeze(1),
                                                                 float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [R, KVH, G, Q]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs.view(r, kvh, groups * q_len, -1), v)  # [R, KVH, G*Q, D]
    out = out.view(r, h, q_len, d).transpose(1, 2)
    return out, lse.view(r, h, q_len).transpose(1, 2)


def combine(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The ranks' partial attentions [C, Q, H, D] with their log-sum-exps [C, Q, H] -> the
    attention over all their keys, [Q, H, D]."""
    top = lses.max(0).values
    weights = torch.exp(lses - torch.where(torch.isinf(top), 0.0, top))  # [C, Q, H]
    total = (outs * weights.unsqueeze(-1)).sum(0)
    return total / weights.sum(0).clamp_min(torch.finfo(weights.dtype).tiny).unsqueeze(-1)
