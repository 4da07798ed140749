"""Penalty state kept across steps: per request with presence, frequency or repetition penalties,
how often each token has been output and which tokens it has seen (prompt or output).

A request's row is built once when it joins and updated with the tokens appended to it, so a
step gathers the rows it samples instead of rebuilding [R, V] counts from every request's whole
history. Slot 0 stays zero: it is the slot of every request without penalties, so one gather
serves a batch that mixes both.
"""
from __future__ import annotations

import numpy as np
import torch


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(1, vocab_size, device=device)  # [slots, V] output counts
        self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []

    def assign(self, prompt: np.ndarray, output: np.ndarray) -> int:
        """A slot holding the counts of `output` and the tokens of both."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        tokens = torch.from_numpy(np.concatenate([prompt, output])).to(self.device)
        self.seen[slot, tokens] = True
        out = tokens[len(prompt):]
        self.counts[slot].index_add_(0, out, torch.ones(len(out), device=self.device))
        return slot

    def release(self, slot: int) -> None:
        if slot:
            self._free.append(slot)

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Output tokens[i] appended to the request in slots[i] (slot 0 entries are ignored)."""
        keep = slots > 0
        if not keep.any():
            return
        s = torch.from_numpy(slots[keep]).to(self.device)
        t = torch.from_numpy(tokens[keep]).to(self.device)
        self.counts.index_put_((s, t), torch.ones(len(s), device=self.device), accumulate=True)
        self.seen[s, t] = True

    def gather(self, slots: np.ndarray, extra_entries: np.ndarray, extra_tokens: np.ndarray,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, V] counts, [R, V] seen) of the requests in `slots`, plus output token
        extra_tokens[i] in entry extra_entries[i] (a draft the entry is sampled after)."""
        index = torch.from_numpy(slots).to(self.device)
        counts, seen = self.counts[index], self.seen[index]
        if len(extra_entries):
            e = torch.from_numpy(extra_entries).to(self.device)
            t = torch.from_numpy(extra_tokens).to(self.device)
            counts.index_put_((e, t), torch.ones(len(e), device=self.device), accumulate=True)
            seen[e, t] = True
        return counts.to(device), seen.to(device)

    def _grow(self) -> None:
        old = len(self.counts)
        new = max(2 * old, 2)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(new - old, self.vocab_size)])
        self._free.extend(range(new - 1, old - 1, -1))
