"""Persistent per-request state of the worker, one row per running request.

Token ids, block tables and sampling parameters live in preallocated numpy arrays, so that each
step's inputs are gathered with vectorized indexing instead of per-request Python work. The
state is built from the SchedulerOutputs alone (a running request's new tokens come in its
delta), never from what this worker sampled: every rank holds the same rows.
"""
from __future__ import annotations

import numpy as np
import torch

from octavo.core.contract import CachedRequestData, NewRequestData
from octavo.params import SamplingParams
from octavo.worker.sampler import SamplingBatch


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int) -> None:
        self.vocab_size = vocab_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int64)
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed = np.zeros(max_num_reqs, np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), np.int64)
        self.num_blocks = np.zeros(max_num_reqs, np.int64)
        self.temperature = np.ones(max_num_reqs, np.float32)
        self.top_k = np.zeros(max_num_reqs, np.int64)
        self.top_p = np.ones(max_num_reqs, np.float32)
        self.min_p = np.zeros(max_num_reqs, np.float32)
        self.presence = np.zeros(max_num_reqs, np.float32)
        self.frequency = np.zeros(max_num_reqs, np.float32)
        self.repetition = np.ones(max_num_reqs, np.float32)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, req: NewRequestData) -> None:
        row = self._free_rows.pop()
        self.row_of[req.req_id] = row
        n = len(req.token_ids)
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, req.block_ids)
        p = req.sampling_params
        self.params[row] = p
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.eos[row] = ([] if p.ignore_eos else req.eos_token_ids) + p.stop_token_ids

    def update(self, reqs: list[CachedRequestData]) -> None:
        """Running requests' deltas: computed counts, new blocks, and the tokens appended to
        each since the worker last saw it (all rows' in one vectorized write)."""
        if not reqs:
            return
        rows = [self.row_of[req.req_id] for req in reqs]
        self.num_computed[rows] = [req.num_computed_tokens for req in reqs]
        token_rows: list[int] = []
        tokens: list[int] = []
        for row, req in zip(rows, reqs):
            if req.new_block_ids:
                self._append_blocks(row, req.new_block_ids)
            if req.new_token_ids:
                token_rows += [row] * len(req.new_token_ids)
                tokens += req.new_token_ids
        if tokens:
            self.append_tokens(np.array(token_rows), np.array(tokens))

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self._free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """tokens[i] after rows[i]'s tokens; a row may repeat (several tokens, in order)."""
        order = np.argsort(rows, kind="stable")
        rows, tokens = rows[order], tokens[order]
        first = np.searchsorted(rows, rows)  # index of each row's first entry
        offset = np.arange(len(rows)) - first
        self.token_ids[rows, self.num_tokens[rows] + offset] = tokens
        np.add.at(self.num_tokens, rows, 1)

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """Put draft tokens after a request's tokens (inputs of the verification; not counted)."""
        n = self.num_tokens[row]
        self.token_ids[row, n:n + len(drafts)] = drafts

    def write_ahead(self, rows: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """tokens[i] at offsets[i] past rows[i]'s tokens, not counted: the tokens a step just
        emitted, for the draft model to run over; the next step's delta appends them."""
        self.token_ids[rows, self.num_tokens[rows] + offsets] = tokens

    def sampling_batch(self, rows: np.ndarray, device: torch.device,
                       lengths: np.ndarray | None = None) -> SamplingBatch:
        """Sampling inputs for `rows` (the requests that sample this step), in that order.
        lengths: the tokens each entry follows, when not the row's own (speculative verification
        samples a row at several positions, each after the drafts before it)."""
        params = [self.params[r] for r in rows]
        greedy = self.temperature[rows] < 1e-5
        t = lambda a: torch.from_numpy(a[rows]).to(device)  # noqa: E731
        lengths = self.num_tokens[rows] if lengths is None else lengths
        num_out = lengths - self.num_prompt_tokens[rows]
        seeds = [None if p.seed is None else _mix(p.seed, int(n)) for p, n in zip(params, num_out)]
        logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
        batch = SamplingBatch(
            temperature=t(self.temperature), top_k=t(self.top_k), top_p=t(self.top_p),
            min_p=t(self.min_p), all_greedy=bool(greedy.all()),
            greedy=torch.from_numpy(greedy).to(device), seeds=seeds,
            presence=None, frequency=None, repetition=None, output_counts=None, seen_mask=None,
            bias_rows=None, bias_tokens=None, bias_values=None, banned_rows=None,
            banned_tokens=None, max_num_logprobs=max(logprob_ks) if logprob_ks else None)
        if any(p.has_penalties() for p in params):
            self._add_penalties(batch, rows, lengths, device)
        bias = [(i, tok, val) for i, p in enumerate(params) for tok, val in
                (p.logit_bias or {}).items()]
        if bias:
            r, tok, val = zip(*bias)
            batch.bias_rows = torch.tensor(r, device=device)
            batch.bias_tokens = torch.tensor(tok, device=device)
            batch.bias_values = torch.tensor(val, dtype=torch.float32, device=device)
        listed = [(i, p.logprob_token_ids) for i, p in enumerate(params)
                  if p.logprob_token_ids is not None]
        if listed:
            width = max(len(ids) for _, ids in listed)
            batch.listed_rows = torch.tensor([i for i, _ in listed], device=device)
            batch.listed_token_ids = torch.tensor(
                [ids + ids[-1:] * (width - len(ids)) for _, ids in listed], device=device)
        banned = [(i, tok) for i, (p, n) in enumerate(zip(params, num_out))
                  if n < p.min_tokens for tok in self.eos[rows[i]]]
        if banned:
            r, tok = zip(*banned)
            batch.banned_rows = torch.tensor(r, device=device)
            batch.banned_tokens = torch.tensor(tok, device=device)
        return batch

    def _add_penalties(self, batch: SamplingBatch, rows: np.ndarray, lengths: np.ndarray,
                       device: torch.device) -> None:
        num_rows = len(rows)
        longest = int(lengths.max())
        tokens = torch.from_numpy(self.token_ids[rows, :longest])  # [R, L]
        pos = torch.arange(longest).unsqueeze(0)
        prompt_len = torch.from_numpy(self.num_prompt_tokens[rows]).unsqueeze(1)
        total_len = torch.from_numpy(lengths).unsqueeze(1)
        is_output = ((pos >= prompt_len) & (pos < total_len)).float()
        counts = torch.zeros(num_rows, self.vocab_size).scatter_add_(1, tokens, is_output)
        seen = torch.zeros(num_rows, self.vocab_size).scatter_add_(
            1, tokens, (pos < total_len).float()) > 0
        batch.output_counts, batch.seen_mask = counts.to(device), seen.to(device)
        batch.presence = torch.from_numpy(self.presence[rows]).to(device)
        batch.frequency = torch.from_numpy(self.frequency[rows]).to(device)
        batch.repetition = torch.from_numpy(self.repetition[rows]).to(device)


def _mix(seed: int, position: int) -> int:
    """A per-(seed, position) generator seed: splitmix64 of the pair."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
