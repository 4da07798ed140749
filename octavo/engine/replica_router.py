"""Which data-parallel replica serves a request: the least loaded one (its unfinished sequences
from this front end), unless another replica computed a request of the same leading tokens
recently and is not much busier: its prefix cache holds those blocks, so the prompt's prefill
there is mostly cache hits.

The router remembers the replica that each leading run of `AFFINITY_BLOCKS` blocks went to (an
LRU of `capacity` runs), which is where that prefix was computed and cached.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 2  # the leading blocks a prompt's affinity key covers
BUSIER_BY = 4  # sequences a cached replica may carry above the least loaded one and still win


class ReplicaRouter:
    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        self.prefix_tokens = AFFINITY_BLOCKS * block_size
        self.capacity = capacity
        self.owner: OrderedDict[tuple, int] = OrderedDict()  # leading tokens -> replica

    def pick(self, prompt: Sequence[int], loads: Sequence[int | None], salt: object = None
             ) -> int:
        """The replica for a prompt; loads: each replica's sequences, None for a dead one.
        salt: what else keys the prefix cache (the adapter, the cache salt)."""
        alive = [i for i, load in enumerate(loads) if load is not None]
        if not alive:
            raise RuntimeError("no replica is alive")
        least = min(alive, key=lambda i: loads[i])
        if len(prompt) < self.prefix_tokens:
            return least
        key = (salt, tuple(prompt[:self.prefix_tokens]))
        cached = self.owner.get(key)
        choice = least
        if cached is not None and loads[cached] is not None \
                and loads[cached] <= loads[least] + BUSIER_BY:
            choice = cached
        self.owner[key] = choice
        self.owner.move_to_end(key)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
        return choice
