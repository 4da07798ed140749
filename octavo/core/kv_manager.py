"""Per-request block tables on top of the block pool."""
from __future__ import annotations

from octavo.core.block_pool import BlockPool
from octavo.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def blocks_of(self, req_id: str) -> list[int]:
        return self.block_tables.get(req_id, [])

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`.

        Returns the newly added block ids (possibly none), or None when the pool is too small
        right now; then nothing changes.
        """
        table = self.block_tables.setdefault(request.req_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.req_id]
            return None
        new = self.pool.allocate(needed)
        table.extend(new)
        return new

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.req_id, None)
        if table:
            # Reverse order: the tail of a sequence is the least useful to keep around.
            self.pool.free(table[::-1])

    def usage(self) -> float:
        return self.pool.usage()
