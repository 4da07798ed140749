"""Persistent per-request state of the worker, one row per running request.

Token ids, block tables and sampling parameters live in preallocated numpy arrays, set when a
request joins, so that each step's inputs are gathered with vectorized indexing instead of
per-request Python work: only the rows that use a sparse extra (logit bias, listed logprob
tokens, min_tokens, a seed) are visited one by one, and penalty counts persist across steps
(penalty_counts.py). The number of running requests that use each extra is kept as they join
and leave, so a step looks only for the extras some request uses (a batch of greedy requests
builds no sampling input at all). The state is built from the SchedulerOutputs alone (a running
request's new tokens come in its delta), never from what this worker sampled: every rank holds
the same rows.
"""
from __future__ import annotations

import numpy as np
import torch

from octavo.core.contract import CachedRequestData, NewRequestData
from octavo.params import SamplingParams
from octavo.worker.penalty_counts import PenaltyCounts
from octavo.worker.sampler import SamplingBatch


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device = torch.device("cpu")) -> None:
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
        self.seed = np.zeros(max_num_reqs, np.int64)  # the request's seed, where has_seed
        self.has_seed = np.zeros(max_num_reqs, bool)
        self.num_logprobs = np.full(max_num_reqs, -1, np.int64)  # -1: no logprobs
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, np.int64)  # -1: none
        self.min_tokens = np.zeros(max_num_reqs, np.int64)
        self.has_bias = np.zeros(max_num_reqs, bool)
        self.has_listed = np.zeros(max_num_reqs, bool)
        self.penalty_slot = np.zeros(max_num_reqs, np.int64)  # 0: no penalties
        self.lora_id = np.zeros(max_num_reqs, np.int64)  # the row's adapter, 0: none
        self.rows_with_lora = 0
        self.penalties = PenaltyCounts(vocab_size, device)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.rows_using = dict.fromkeys(SAMPLING_EXTRAS, 0)  # extra -> running rows using it
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
        self.has_seed[row] = p.seed is not None
        self.seed[row] = 0 if p.seed is None else p.seed
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[row] = p.min_tokens
        self.has_bias[row] = bool(p.logit_bias)
        self.has_listed[row] = p.logprob_token_ids is not None
        prompt, output = np.split(self.token_ids[row, :n], [req.num_prompt_tokens])
        self.penalty_slot[row] = self.penalties.assign(prompt, output) if p.has_penalties() else 0
        self.eos[row] = ([] if p.ignore_eos else req.eos_token_ids) + p.stop_token_ids
        for extra in sampling_extras(p):
            self.rows_using[extra] += 1
        self.lora_id[row] = 0 if req.lora_request is None else req.lora_request.lora_int_id
        self.rows_with_lora += bool(self.lora_id[row])

    def update(self, reqs: list[CachedRequestData]) -> None:
        """Running requests' deltas: computed counts, new blocks, and the tokens appended to
        each since the worker last saw it (all rows' in one vectorized write)."""
        if not reqs:
            return
        rows = [self.row_of[req.req_id] for req in reqs]
        self.num_computed[rows] = [req.num_computed_tokens for req in reqs]
        token_rows: list[int] = []
        offsets: list[int] = []
        tokens: list[int] = []
        counts: list[int] = []
        for row, req in zip(rows, reqs):
            if req.new_block_ids:
                self._append_blocks(row, req.new_block_ids)
            new = req.new_token_ids
            counts.append(len(new))
            if new:
                token_rows += [row] * len(new)
                offsets += range(len(new))
                tokens += new
        if tokens:  # each request once in `reqs`: a row's tokens are together, in order
            self._write_tokens(np.array(token_rows), np.array(offsets), np.array(tokens))
            self.num_tokens[rows] += counts

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            for extra in sampling_extras(self.params[row]):
                self.rows_using[extra] -= 1
            self.params[row] = None
            self.penalties.release(int(self.penalty_slot[row]))
            self.penalty_slot[row] = 0
            self.rows_with_lora -= bool(self.lora_id[row])
            self.lora_id[row] = 0
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
        self._write_tokens(rows, np.arange(len(rows)) - first, tokens)
        np.add.at(self.num_tokens, rows, 1)

    def _write_tokens(self, rows: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """tokens[i] at offsets[i] past rows[i]'s counted tokens, as output (penalty counts)."""
        self.token_ids[rows, self.num_tokens[rows] + offsets] = tokens
        if self.rows_using["penalties"]:
            self.penalties.append(self.penalty_slot[rows], tokens)

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
        using = self.rows_using
        batch = self.random_sampling(rows, device) if using["random"] else None
        if batch is None or batch.all_greedy:
            batch = SamplingBatch(all_greedy=True)
        lengths = self.num_tokens[rows] if lengths is None else lengths
        num_out = lengths - self.num_prompt_tokens[rows]
        if not batch.all_greedy:
            batch.seeds = self.row_seeds(rows, num_out)
        if using["logprobs"]:
            most = int(self.num_logprobs[rows].max())
            batch.max_num_logprobs = most if most >= 0 else None
        if using["penalties"] and self.penalty_slot[rows].any():
            self._add_penalties(batch, rows, lengths, device)
        sparse = lambda flags: np.flatnonzero(flags).tolist()  # noqa: E731
        bias = [] if not using["bias"] else [
            (i, tok, val) for i in sparse(self.has_bias[rows])
            for tok, val in self.params[rows[i]].logit_bias.items()]
        if bias:
            r, tok, val = zip(*bias)
            batch.bias_rows = torch.tensor(r, device=device)
            batch.bias_tokens = torch.tensor(tok, device=device)
            batch.bias_values = torch.tensor(val, dtype=torch.float32, device=device)
        listed = [] if not using["listed"] else [
            (i, self.params[rows[i]].logprob_token_ids) for i in sparse(self.has_listed[rows])]
        if listed:
            width = max(len(ids) for _, ids in listed)
            batch.listed_rows = torch.tensor([i for i, _ in listed], device=device)
            batch.listed_token_ids = torch.tensor(
                [ids + ids[-1:] * (width - len(ids)) for _, ids in listed], device=device)
        banned = [] if not using["min_tokens"] else [
            (i, tok) for i in sparse(num_out < self.min_tokens[rows]) for tok in self.eos[rows[i]]]
        if banned:
            r, tok = zip(*banned)
            batch.banned_rows = torch.tensor(r, device=device)
            batch.banned_tokens = torch.tensor(tok, device=device)
        return batch

    def random_sampling(self, rows: np.ndarray, device: torch.device) -> SamplingBatch:
        """The rows' temperature and truncation (top-k, top-p, min-p), unseeded."""
        t = lambda a: torch.from_numpy(a[rows]).to(device)  # noqa: E731
        greedy = self.temperature[rows] < 1e-5
        return SamplingBatch(
            all_greedy=bool(greedy.all()), temperature=t(self.temperature), top_k=t(self.top_k),
            top_p=t(self.top_p), min_p=t(self.min_p), greedy=torch.from_numpy(greedy).to(device),
            seeds=np.full(len(rows), -1, np.int64))

    def row_seeds(self, rows: np.ndarray, positions: np.ndarray, salt: int = 0) -> np.ndarray:
        """Each row's generator seed at `positions` (its seed ^ salt mixed with the position),
        -1 for a row without a seed."""
        seeded = self.has_seed[rows] if self.rows_using["seed"] else None
        if seeded is None or not seeded.any():
            return np.full(len(rows), -1, np.int64)
        return np.where(seeded, mix_seeds(self.seed[rows] ^ salt, positions), -1)

    def _add_penalties(self, batch: SamplingBatch, rows: np.ndarray, lengths: np.ndarray,
                       device: torch.device) -> None:
        # An entry sampled past the row's counted tokens (speculative verification) also counts
        # the drafts before it.
        ahead = lengths - self.num_tokens[rows]
        extra_entries = np.repeat(np.arange(len(rows)), ahead)
        first = np.cumsum(ahead) - ahead
        offsets = np.arange(len(extra_entries)) - first[extra_entries]
        extra_rows = rows[extra_entries]
        extra_tokens = self.token_ids[extra_rows, self.num_tokens[extra_rows] + offsets]
        slots = self.penalty_slot[rows]
        keep = slots[extra_entries] > 0
        batch.output_counts, batch.seen_mask = self.penalties.gather(
            slots, extra_entries[keep], extra_tokens[keep], device)
        batch.presence = torch.from_numpy(self.presence[rows]).to(device)
        batch.frequency = torch.from_numpy(self.frequency[rows]).to(device)
        batch.repetition = torch.from_numpy(self.repetition[rows]).to(device)


SAMPLING_EXTRAS = ("random", "seed", "logprobs", "prompt_logprobs", "penalties", "bias", "listed",
                   "min_tokens")


def sampling_extras(p: SamplingParams) -> list[str]:
    """The SAMPLING_EXTRAS a request's sampling uses."""
    uses = {"random": not p.greedy, "seed": p.seed is not None,
            "logprobs": p.logprobs is not None, "prompt_logprobs": p.prompt_logprobs is not None,
            "penalties": p.has_penalties(),
            "bias": bool(p.logit_bias), "listed": p.logprob_token_ids is not None,
            "min_tokens": p.min_tokens > 0}
    return [extra for extra in SAMPLING_EXTRAS if uses[extra]]


def mix_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per-(seed, position) generator seeds in [0, 2**63): splitmix64 of each pair, computed
    modulo 2**64 (an int64 seed is taken as its two's-complement bits)."""
    z = seeds.astype(np.int64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15) \
        + positions.astype(np.uint64) + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)
