"""Saved recurrent states for prefix caching over linear-attention layers (Qwen3-Next).

A linear-attention layer keeps one running state per request instead of a K/V entry per token,
so cached KV blocks alone cannot resume a request in the middle of its prompt: the state after
the prefix is needed too. Every `interval` tokens (a whole number of blocks) of a request's
tokens, the worker copies its states into a checkpoint slot, named by the block hash that ends
there (which covers the whole prefix, adapter and salt included). A later request whose cached
prefix reaches such a boundary resumes from it: the worker copies the slot into its row before
the step, and the prefix's attention layers read the cached blocks as usual. A prefix that
reaches no saved boundary gives no hit.

The slots are a fixed pool (allocated by the worker beside the running states), replaced least
recently used first. The core only decides: which slot is saved at which token of which step
(`reserve`, from KVCacheManager.plan_state_saves), and which slot a new request starts from
(`take`). Slots of the current step are
never handed out twice in it. A step that fails forgets the slots its requests were saving
(`forget_owner`), as the KV manager forgets their blocks.

Spans that end in draft tokens save nothing: their states move only once the drafts are judged
(worker/spec/verified_spans.py), possibly past a boundary; the next boundary is saved instead.
"""
from __future__ import annotations

from collections import OrderedDict

from octavo.core.hashing import BlockHash


class StateCheckpoints:
    def __init__(self, num_slots: int, interval: int) -> None:
        if num_slots < 0 or interval < 1:
            raise ValueError(f"state checkpoints: {num_slots} slots every {interval} tokens")
        self.interval = interval
        self.num_slots = num_slots
        self._slot_of: dict[BlockHash, int] = {}
        self._hash_of: list[BlockHash | None] = [None] * num_slots
        self._owner: list[str | None] = [None] * num_slots  # the request that saved it
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._this_step: set[int] = set()
        self.saves = 0
        self.restores = 0

    def begin_step(self) -> None:
        self._this_step.clear()

    def find(self, block_hash: BlockHash) -> int | None:
        return self._slot_of.get(block_hash)

    def take(self, block_hash: BlockHash) -> int:
        """The slot a new request resumes from this step (kept from replacement in it)."""
        slot = self._slot_of[block_hash]
        self._lru.move_to_end(slot)
        self._this_step.add(slot)
        self.restores += 1
        return slot

    def reserve(self, block_hash: BlockHash, owner: str) -> int | None:
        """A slot for the states at the boundary `block_hash` ends, saved by `owner`'s step;
        None where that boundary is saved already or every slot is in use this step."""
        if block_hash in self._slot_of:
            self._lru.move_to_end(self._slot_of[block_hash])
            return None
        slot = next((s for s in self._lru if s not in self._this_step), None)
        if slot is None:
            return None
        self._drop(slot)
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._owner[slot] = owner
        self._lru.move_to_end(slot)
        self._this_step.add(slot)
        self.saves += 1
        return slot

    def forget_owner(self, owner: str) -> None:
        """Forget every slot `owner` saved (its step failed: they may be half written)."""
        for slot, who in enumerate(self._owner):
            if who == owner:
                self._drop(slot)

    def reset(self) -> None:
        for slot in range(self.num_slots):
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        old = self._hash_of[slot]
        if old is not None:
            del self._slot_of[old]
        self._hash_of[slot] = None
        self._owner[slot] = None

    def __len__(self) -> int:
        return len(self._slot_of)
