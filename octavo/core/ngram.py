"""N-gram (prompt lookup) drafts for speculative decoding, proposed in the core.

The core holds every request's token ids, so it proposes right where it schedules: for a request
that is decoding, find the latest earlier occurrence of its last n tokens that is followed by k
tokens (else the earliest occurrence; n from `prompt_lookup_max` down to `prompt_lookup_min`, the
longest match wins) and propose the tokens that followed it. The drafts travel to the worker in the SchedulerOutput and are verified there.
The lookup is one vectorized comparison per n over the request's tokens (numpy); the scheduler
calls it once per decoding request, a Python loop over the running requests that costs
microseconds each against the forward pass.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from octavo.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `token_ids`, or [] without a match."""
        k = min(self.k, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: each is followed by at least one token.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                # The latest occurrence that still has k tokens after it (the most recent
                # context); in a short loop the latest ones are too close to the end, and the
                # earliest has the longest continuation.
                full = hits[hits + n + k <= length]
                start = int(full[-1] if len(full) else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
