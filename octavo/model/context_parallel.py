"""Context parallelism in the model: the attention layers' exchange between the ranks of a
context-parallel group, and the split of a step's tokens around the forward pass.

The math of a rank's share (which tokens, which keys, attention with its log-sum-exp) is in
kernels/context_parallel.py; this module adds the collectives. With split tokens, each rank runs
the layers over its own rows only (the linear layers' work is divided), and the attention layers
gather the step's keys and values so that every rank can write the ones it keeps; with the KV
sharded, every rank attends all of the step's queries to its keys and the group combines the
partial outputs by their log-sum-exp. After the last layer the ranks gather their rows, so the
LM head and the sampler see the whole step, as without context parallelism.
"""
from __future__ import annotations

import torch

from octavo.distributed import parallel_state
from octavo.kernels.context_parallel import ContextParallelStep, combine, partial_attention
from octavo.kernels.fused import write_kv


def own_rows(step: ContextParallelStep, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the step's per-token `x`, padded (with zeros: token 0 at position 0,
    whose output is dropped) to the chunk every rank computes."""
    if not step.split:
        return x
    return _padded(x[step.own_start:step.own_end], step.chunk)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows after it up to `rows`."""
    missing = rows - len(x)
    return x if missing == 0 else torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])


def gather_rows(step: ContextParallelStep, x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows (`chunk` each, in token order) -> the step's [T, ...]."""
    if not step.split:
        return x
    every = parallel_state.cp_all_gather(x)
    return every.reshape(-1, *x.shape[1:])[:step.num_tokens]


def _gather_together(step: ContextParallelStep, parts: list[torch.Tensor]
                     ) -> list[torch.Tensor]:
    """gather_rows of several per-token tensors of one dtype, as one collective."""
    rows = gather_rows(step, torch.cat([p.flatten(1) for p in parts], 1))
    pieces = rows.split([p[0].numel() for p in parts], 1)
    return [piece.unflatten(1, p.shape[1:]) for piece, p in zip(pieces, parts)]


def attention(step: ContextParallelStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cache: torch.Tensor, scale: float, softcap: float | None, window: int | None,
              k_scale: float, v_scale: float) -> torch.Tensor:
    """q: [rows, H, D], k/v: [rows, KVH, D] of this rank's rows -> its rows' attention output,
    [rows, H, D]."""
    if step.split:  # one collective for the step's K and V (and Q)
        k, v, *rest = _gather_together(step, [k, v] + ([q] if step.cp.shard_kv else []))
        q = rest[0] if rest else q
    write_kv(cache, k[step.write_index], v[step.write_index], step.write_slots, k_scale,
             v_scale)
    queries = q[:step.query_end - step.query_start]
    out, lse = partial_attention(queries, cache, step, scale, softcap, window, k_scale, v_scale)
    if step.cp.shard_kv:  # one collective for the outputs and their log-sum-exps
        heads, dim = out.shape[1:]
        every = parallel_state.cp_all_gather(torch.cat([out.flatten(1), lse], 1))
        out = combine(every[..., :heads * dim].unflatten(-1, (heads, dim)),
                      every[..., heads * dim:])
        out = own_rows(step, out)
    else:  # this rank's own queries, and its padding rows
        out = _padded(out, len(q))
    return out.to(q.dtype)
