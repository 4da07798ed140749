"""Batched sampling: token bitmasks (grammars, allowed_token_ids, bad_words), penalties, logit
bias, min_tokens, temperature, top-k/top-p/min-p, seeds; logprobs of the top-k or of listed
tokens.

Everything is a tensor op over the whole batch. Random rows sample by exponential-noise argmax
(argmax p_i / e_i with e_i ~ Exp(1) draws i with probability p_i). A seeded request draws its
noise from a generator reseeded from (seed, output position), so its tokens do not depend on the
batch it runs in, nor on preemption. A constrained request's bitmask (its grammar and token
mask) is applied first, so the logprobs it returns are those of the distribution restricted to
it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from octavo.core.contract import TopLogprobs


@dataclass
class SamplingBatch:
    """Per-step sampling inputs for R rows (built by the InputBatch). Each extra is None where
    no row uses it; a batch of greedy rows alone carries none of the random rows' inputs."""

    all_greedy: bool
    # The random rows' inputs (None when all_greedy: the sampler takes the argmax alone)
    temperature: torch.Tensor | None = None  # [R] float32
    top_k: torch.Tensor | None = None  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None  # [R] float32
    min_p: torch.Tensor | None = None  # [R] float32
    greedy: torch.Tensor | None = None  # [R] bool
    seeds: np.ndarray | None = None  # [R] int64, already mixed with the output position; -1:
    # unseeded
    presence: torch.Tensor | None = None  # [R] (None: no row has penalties)
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [R, V] counts of each output token so far
    seen_mask: torch.Tensor | None = None  # [R, V] bool: token in prompt or output (repetition)
    bias_rows: torch.Tensor | None = None  # sparse logit bias: rows, token ids, values
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None  # min_tokens: (row, token) pairs set to -inf
    banned_tokens: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # None: no row asked for logprobs
    grammar_rows: torch.Tensor | None = None  # [G] int64: rows constrained by a grammar
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32, bit set = allowed
    # logprob_token_ids: row listed_rows[i] returns the logprobs of listed_token_ids[i] (padded
    # by repeating its last id) in place of its top-k
    listed_rows: torch.Tensor | None = None  # [S] int64
    listed_token_ids: torch.Tensor | None = None  # [S, M] int64
    # Speculative verification against a draft model's distribution (spec.rejection): row
    # draft_rows[i] verifies draft token draft_tokens[i], drawn from draft_probs[i].
    draft_rows: torch.Tensor | None = None  # [D] int64
    draft_tokens: torch.Tensor | None = None  # [D] int64
    draft_probs: torch.Tensor | None = None  # [D, V] float32


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)
        self._byte_masks = byte_mask_table(device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[torch.Tensor, TopLogprobs | None]:
        """logits: [R, V] float32 -> sampled token ids [R], logprobs of the model output (within
        the grammar, for constrained rows)."""
        if batch.grammar_rows is not None:
            apply_token_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask,
                                self._byte_masks)
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, batch)
        if batch.bias_rows is not None:
            logits[batch.bias_rows, batch.bias_tokens] += batch.bias_values
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_tokens] = float("-inf")
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            sampled = greedy_tokens
        else:
            probs = self.probabilities(logits, batch)
            noise = self.exponential_noise(probs, batch.seeds)
            drawn = (probs / noise).argmax(dim=-1)
            if batch.draft_rows is not None:
                drawn[batch.draft_rows] = verify_drafts(
                    probs[batch.draft_rows], noise[batch.draft_rows], batch.draft_tokens,
                    batch.draft_probs)
            sampled = torch.where(batch.greedy, greedy_tokens, drawn)
        top = None
        if raw_logprobs is not None:
            top = gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)
            if batch.listed_rows is not None:
                add_listed_logprobs(top, raw_logprobs, batch.listed_rows,
                                    batch.listed_token_ids)
        return sampled, top

    @staticmethod
    def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution random rows sample from, after temperature and truncation."""
        temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temp.unsqueeze(1)
        if bool((batch.top_k > 0).any()) or bool((batch.top_p < 1.0).any()):
            logits = truncate_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if bool((batch.min_p > 0).any()):
            keep = probs >= batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def exponential_noise(self, probs: torch.Tensor, seeds: np.ndarray) -> torch.Tensor:
        """Exp(1) noise shaped like probs; a row with a seed (>= 0) draws from that seed alone."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row in np.flatnonzero(seeds >= 0).tolist():
            self._row_generator.manual_seed(int(seeds[row]))
            noise[row].exponential_(generator=self._row_generator)
        return noise


def verify_drafts(probs: torch.Tensor, noise: torch.Tensor, drafts: torch.Tensor,
                  draft_probs: torch.Tensor) -> torch.Tensor:
    """Speculative sampling at D positions: keep draft token d (drawn from q = draft_probs) with
    probability min(1, p(d) / q(d)), else draw from max(0, p - q) renormalized; the result is
    distributed as p. probs, noise, draft_probs: [D, V]; drafts: [D]. The uniform draw is
    exp(-noise[d]) (Exp(1) noise makes it uniform); on rejection p(d) < q(d), so the residual is
    0 at d and the draw from it reads only the other positions' noise, independent of it."""
    d = drafts.unsqueeze(1)
    p_d = probs.gather(1, d).squeeze(1)
    q_d = draft_probs.gather(1, d).squeeze(1)
    accept = torch.exp(-noise.gather(1, d).squeeze(1)) * q_d < p_d
    residual = (probs - draft_probs).clamp_(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to round-off: draw from p
    residual = torch.where(empty, probs, residual)
    return torch.where(accept, drafts, (residual / noise).argmax(dim=-1))


def byte_mask_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """[256, 8] float32: row b holds 0 where bit i of byte b is set, -inf where it is clear."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                        table: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf unless bit t % 32 of bitmask[i, t // 32] is set.
    The packed mask travels (32x smaller than a bool one); each of its bytes becomes 8 additive
    0 / -inf entries by one table lookup, added to the rows in one call (a boolean masked_fill
    over the rows costs about 6x more on the CPU). `table` is byte_mask_table(), on the device."""
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {bitmask.shape[-1] * 32} tokens, "
                         f"the logits {vocab}")
    # int32 words viewed as bytes: little-endian, so byte j of a row holds tokens 8j .. 8j + 7.
    data = bitmask.contiguous().view(torch.uint8).flatten().int()
    add = table.index_select(0, data).view(len(rows), -1)[:, :vocab]  # [G, V]
    logits.index_add_(0, rows, add.to(logits.dtype))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.repetition is not None:
        pen = batch.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(batch.seen_mask, penalized, logits)
    if batch.frequency is not None:
        counts = batch.output_counts
        logits = logits - batch.frequency.unsqueeze(1) * counts
        logits = logits - batch.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def truncate_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor:
    """Set every logit outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token when the mass strictly before it is below top_p: the nucleus is the smallest
    # prefix whose mass reaches top_p, and the most likely token always stays. Rows with
    # top_p >= 1 are left alone: float32 round-off in the cumsum would otherwise cut their tail.
    mass_before = probs.cumsum(dim=-1) - probs
    cut = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> TopLogprobs:
    """logprobs: [N, V], chosen: [N] -> the chosen token's logprob and rank, plus the top-k."""
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([chosen.unsqueeze(1), top_ids], dim=1)
        lps = torch.cat([chosen_lp, top_lp], dim=1)
    else:
        ids, lps = chosen.unsqueeze(1), chosen_lp
    return TopLogprobs(ids.cpu().numpy(), lps.float().cpu().numpy(), ranks.cpu().numpy())


def add_listed_logprobs(top: TopLogprobs, logprobs: torch.Tensor, rows: torch.Tensor,
                        token_ids: torch.Tensor) -> None:
    """In place: columns 1..M of `rows` become the listed tokens' logprobs, with their ranks in
    top.token_ranks (every other row keeps its top-k, column c ranked c). logprobs: [N, V];
    token_ids: [S, M]; top is at least 1 + M columns wide."""
    picked = logprobs[rows].gather(1, token_ids)  # [S, M]
    ascending = logprobs[rows].sort(dim=-1).values
    # rank = 1 + the number of tokens strictly more likely
    ranks = logprobs.shape[-1] - torch.searchsorted(ascending, picked, right=True) + 1
    width = top.token_ids.shape[1]
    token_ranks = np.broadcast_to(np.arange(width, dtype=np.int64), top.token_ids.shape).copy()
    token_ranks[:, 0] = top.ranks
    r, m = rows.cpu().numpy(), token_ids.shape[1]
    top.token_ids[r, 1:m + 1] = token_ids.cpu().numpy()
    top.logprobs[r, 1:m + 1] = picked.float().cpu().numpy()
    token_ranks[r, 1:m + 1] = ranks.cpu().numpy()
    top.token_ranks = token_ranks
