"""The KV cache's size when none is given. On the CPU, whose memory the machine shares: enough
for one request of the full context (at least the 1 GiB of old), within a share of the memory
left after the weights. On a GPU (`fill`): all that the executor says the KV cache may take (the
worker's memory plan, worker/memory.py). Where that cannot hold one full-length request, the
context is cut to what it holds, with a warning. An explicit `kv_cache_memory` is used as given
(EngineCore refuses one too small for a request).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 1 << 30  # the floor of an automatic budget: what every start used to take


@dataclass(frozen=True)
class KVPlan:
    kv_cache_memory: int
    max_model_len: int
    available: int | None  # bytes left after the weights, where the system says


def plan_kv(explicit: int | None, fraction: float, bytes_per_block: int | None, block_size: int,
            max_model_len: int, tokens_needed: Callable[[int], int],
            available: int | None, fill: bool = False) -> KVPlan:
    """`tokens_needed(max_len)`: the KV tokens one request of that context may hold at once.
    `fill`: the KV cache takes all of `available` (a GPU's plan), not a `fraction` of it."""
    if bytes_per_block == 0:  # an encoder: nothing is cached
        return KVPlan(0, max_model_len, available)
    if explicit is not None or bytes_per_block is None or available is None:
        return KVPlan(explicit if explicit is not None else DEFAULT_KV_BYTES, max_model_len,
                      available)
    per_request = -(-tokens_needed(max_model_len) // block_size) * bytes_per_block
    share = available if fill else int(available * fraction)
    budget = share if fill else min(max(DEFAULT_KV_BYTES, per_request), share)
    what = (f"the {available / 2**30:.2f} GiB the GPU's memory plan leaves for the KV cache"
            if fill else f"{fraction:.0%} of the {available / 2**30:.2f} GiB left after the "
            f"weights")
    if budget >= per_request:
        return KVPlan(budget, max_model_len, available)
    fitted = (budget // bytes_per_block) * block_size
    while fitted > 1 and tokens_needed(fitted) > fitted - fitted % block_size:
        fitted -= block_size  # sliding windows: what one request holds is not its context
    if fitted < 2:
        raise ValueError(f"kv_cache_memory: {what} cannot hold even one KV block "
                         f"({bytes_per_block} bytes); free memory, raise "
                         f"--kv-cache-memory-fraction (--gpu-memory-utilization) or pass "
                         f"--kv-cache-memory")
    logger.warning("max_model_len cut from %d to %d tokens: one full-length request needs "
                   "%.2f GiB of KV cache, and %s is %.2f GiB (set --kv-cache-memory or "
                   "--max-model-len to choose)", max_model_len, fitted, per_request / 2**30,
                   what, budget / 2**30)
    return KVPlan(budget, fitted, available)
