"""Per-request block tables on top of the block pool: cached-prefix lookup, allocation, caching of
full blocks, freeing, and the accounting of hits and unused slots.

Sliding windows: when every layer of the model attends only to the latest `sliding_window` tokens
(Mistral), a block whose tokens all lie before the window of the request's next query is never
read again, so it is released as the request advances (its table keeps the id, so positions still
map to slots; the worker only reads it under a mask that excludes it). Models that interleave
sliding and global layers (Gemma 2/3) keep every block: one block id holds a position's K/V for
all layers, and the global layers still read it. Freeing per layer group would need a block table
per group; it is not done.

Linear-attention layers (Qwen3-Next): a cached prefix is usable only up to a boundary whose
recurrent states were saved (core/state_checkpoints.py); the manager plans those saves and finds
the saved states a hit resumes from.
"""
from __future__ import annotations

from octavo.core.block_pool import BlockPool
from octavo.core.hashing import extend_block_hashes
from octavo.core.request import Request
from octavo.core.state_checkpoints import StateCheckpoints


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 checkpoints: StateCheckpoints | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # set only when every layer slides
        # models with linear-attention layers, with caching: their saved states
        self.checkpoints = checkpoints if enable_caching else None
        self._num_released: dict[str, int] = {}  # leading blocks of a table already given back
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a table already in the cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in the cache
        self.slots_allocated = 0  # over finished tables: slots they held ...
        self.slots_unwritten = 0  # ... and how many of those were never written

    def blocks_of(self, req_id: str) -> list[int]:
        return self.block_tables.get(req_id, [])

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                request.cache_extra_keys())

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks holding the longest prefix of `request` and the tokens they cover.
        At least one token is always left to compute; requests asking for prompt logprobs get no
        hits (they need the logits of every prompt position), nor pooling requests but those
        that read only their last position (the others pool every position's state)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None \
                or (request.pooling_params is not None and request.pooled_positions != "last"):
            return [], 0
        self._update_hashes(request)
        bs = self.block_size
        usable = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        hits: list[int] = []
        if usable:
            tokens = request.all_token_ids
            for i in range(usable):
                b = self.pool.lookup(request.block_hashes[i], tokens[i * bs:(i + 1) * bs])
                if b is None:
                    break
                hits.append(b)
        if self.checkpoints is not None:  # the states must be restorable where the hit ends
            hits = hits[:self._last_saved_boundary(request, len(hits))]
        return hits, len(hits) * bs

    def _last_saved_boundary(self, request: Request, num_blocks: int) -> int:
        """The most leading blocks, at most `num_blocks`, that end where states were saved."""
        step = self.checkpoints.interval // self.block_size
        for n in range(num_blocks - num_blocks % step, 0, -step):
            if self.checkpoints.find(request.block_hashes[n - 1]) is not None:
                return n
        return 0

    def begin_step(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.begin_step()

    def state_restore(self, request: Request, num_hit: int) -> int | None:
        """The saved states a request whose first `num_hit` tokens are hits starts from."""
        if self.checkpoints is None or not num_hit:
            return None
        return self.checkpoints.take(request.block_hashes[num_hit // self.block_size - 1])

    def plan_state_saves(self, request: Request, start: int,
                         count: int) -> list[tuple[int, int]]:
        """For a step computing tokens start .. start + count of `request`: (tokens into the
        step, slot) of each boundary it reaches whose states are to be saved."""
        if self.checkpoints is None:
            return []
        self._update_hashes(request)
        interval, saves = self.checkpoints.interval, []
        first = (start // interval + 1) * interval
        for end in range(first, start + count + 1, interval):
            index = end // self.block_size - 1
            if index >= len(request.block_hashes):
                break
            slot = self.checkpoints.reserve(request.block_hashes[index], request.req_id)
            if slot is not None:
                saves.append((end - start, slot))
        return saves

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`, after reusing
        `hit_blocks` (from get_computed_blocks) as its leading blocks.

        Returns the newly allocated block ids (possibly none), or None when the pool is too small
        right now; then nothing changes but the release of blocks behind the window.
        """
        hits = hit_blocks or []
        table = self.block_tables.get(request.req_id, [])
        computed = request.num_computed_tokens + len(hits) * self.block_size
        if self.sliding_window is not None and table:
            self._release_out_of_window(request.req_id, table, computed)
        needed = cdiv(computed + num_new_tokens, self.block_size) - len(table) - len(hits)
        # Hits behind the window are given back right after they are taken: they cost nothing.
        first = len(table)
        if self.sliding_window is not None:
            first = max(first, self._window_start(computed))
        idle_hits = sum(1 for i, b in enumerate(hits, len(table))
                        if i >= first and self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_free_blocks - idle_hits:
            return None
        table = self.block_tables.setdefault(request.req_id, table)
        if hits:
            self.pool.touch(hits)  # before allocating, so the hits cannot be evicted
            table.extend(hits)
            if self.sliding_window is not None:
                self._release_out_of_window(request.req_id, table, computed)
        new = self.pool.allocate(max(needed, 0))
        table.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, table, computed + num_new_tokens)
        return new

    def _window_start(self, computed: int) -> int:
        """Index of the first block that the query at `computed` or any later one reads."""
        return max(computed - self.sliding_window + 1, 0) // self.block_size

    def _release_out_of_window(self, req_id: str, table: list[int], computed: int) -> None:
        start = self._num_released.get(req_id, 0)
        end = min(self._window_start(computed), len(table))
        if end > start:
            self.pool.free(table[start:end][::-1])
            self._num_released[req_id] = end

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks a request holds a reference on (its table minus those released)."""
        return len(self.blocks_of(req_id)) - self._num_released.get(req_id, 0)

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        if request.pooling_params is not None and request.pooled_positions == "whole":
            return  # an encoder writes no KV: nothing to offer
        self._update_hashes(request)
        start = self._num_cached.get(request.req_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(start, end):
            self.pool.cache(table[i], request.block_hashes[i], tokens[i * bs:(i + 1) * bs])
        self._num_cached[request.req_id] = end

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.req_id, None)
        self._num_cached.pop(request.req_id, None)
        released = self._num_released.pop(request.req_id, 0)
        if table:
            slots = len(table) * self.block_size
            self.slots_allocated += slots
            self.slots_unwritten += max(0, slots - request.num_computed_tokens)
            # Reverse order: the tail of a sequence is the least useful to keep cached.
            self.pool.free(table[released:][::-1])

    def uncache(self, req_id: str) -> None:
        """Make none of the request's blocks findable by hash (after a failed step their
        contents may be half written); they stay in its table."""
        for block in self.blocks_of(req_id):
            self.pool.uncache(block)
        if self.checkpoints is not None:
            self.checkpoints.forget_owner(req_id)

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_cache():
            return False
        if self.checkpoints is not None:
            self.checkpoints.reset()
        return True

    def usage(self) -> float:
        return self.pool.usage()
