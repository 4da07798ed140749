"""What one decoder layer keeps in the paged KV cache per token, so that the worker allocates
each layer's cache by its model's description and the budget counts its true bytes: K and V of
some heads (most attention), or one latent row that attention reads as both (DeepSeek's
multi-head latent attention: the compressed KV and the shared RoPE key, far fewer bytes), or
nothing (a layer of linear attention, whose state is per request)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    parts: int  # 2: K and V; 1: one row a token, read as both K and V
    heads: int  # this rank's KV heads
    width: int  # features a head

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.parts, num_blocks, block_size, self.heads, self.width)

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return self.parts * block_size * self.heads * self.width * element_size

    def as_kv(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as attention takes it, [2, blocks, block_size, heads, width]: a one-part
        cache is its own K and V (a view: one copy of the memory)."""
        return cache if self.parts == 2 else cache.expand(2, -1, -1, -1, -1)


NO_KV = KVCacheSpec(2, 0, 0)  # a layer that caches nothing per token (an empty tensor)
