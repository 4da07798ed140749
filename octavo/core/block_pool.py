"""The pool of KV-cache blocks: ids, reference counts and the queue of free blocks."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids. A block is free when its reference count is 0.

    Free blocks wait in a FIFO queue so that the least recently freed block is reused first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; those left unreferenced go back to the queue."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
