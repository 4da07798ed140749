"""The pool of KV-cache blocks: ids, reference counts, the hash → block map of cached full blocks,
and the free blocks.

A free block (reference count 0) that holds a cached full block keeps its hash and stays findable
until it is handed out again: only then is it evicted. Free blocks come in two kinds:
- plain ones (no cached content) go out first, the most recently freed first: their memory is
  already mapped and may still be in the CPU's caches (a fresh page costs a fault and a zeroing
  on first write, about a fifth of a prefill's non-GEMM time here when blocks rotated through the
  whole pool);
- cached ones go out only when no plain block is left, the least recently freed first (an LRU),
  so that a prefix stays findable as long as possible.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from octavo.core.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: 0 on top
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) + len(self._cached_free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def allocate(self, count: int) -> list[int]:
        """Hand out `count` blocks: plain ones first, then cached ones (evicting their content)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference of each block; those left unreferenced become free."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    self._plain.append(b)
                else:
                    self._cached_free[b] = None

    # -- prefix cache ----------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | None:
        """The cached block holding exactly `tokens` under `block_hash`, if any."""
        b = self.cached.get(block_hash)
        if b is None or self.block_tokens[b] != tuple(tokens):
            return None
        return b

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses (out of the free queue if idle)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._cached_free[b]  # a block found by its hash is a cached one
            self.ref_counts[b] += 1

    def cache(self, block: int, block_hash: BlockHash, tokens: Sequence[int]) -> None:
        """Register a full, referenced block under its hash (first writer wins)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(tokens)
        self.cached[block_hash] = block

    def uncache(self, block: int) -> None:
        """Forget a block's cached content (it may be in use; it stays allocated)."""
        if self.block_hash[block] is None:
            return
        self._evict(block)
        if self.ref_counts[block] == 0:  # an idle cached block becomes a plain free one
            del self._cached_free[block]
            self._plain.append(block)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
            self.num_evictions += 1

    def reset_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in range(self.num_blocks):
            self.block_hash[b] = None
            self.block_tokens[b] = None
        self.cached.clear()
        self._plain.extend(self._cached_free)  # the most recently freed on top
        self._cached_free.clear()
        return True
