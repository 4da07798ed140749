"""Exact rejection sampling of draft tokens: the leading run of accepted drafts, then the
target's token at the first rejection (or the bonus token after the last draft).

Speculative sampling accepts draft token d at a position with probability min(1, p(d) / q(d))
and, on rejection, samples from max(0, p - q) renormalized, where p is the target distribution
(the request's whole sampling pipeline applied to the target logits at that position) and q the
draft distribution. The sampler draws each verified position's token so that it equals d exactly
when d is accepted, and is the rejection's replacement otherwise; this module only keeps the
leading matches.

- A draft model's q is known (the worker keeps it from the proposal): `sampler.verify_drafts`
  does the test and the residual draw for those positions.
- An n-gram draft's q is a point mass on d: accept with probability p(d); on rejection sample
  from p with d removed. Drawing x ~ p and accepting d when x == d does exactly that:
  P(accept) = p(d), and when x != d, x is distributed as p(x) / (1 - p(d)) over x != d. So the
  sampler runs unchanged on those positions.

Greedy rows need neither: d is accepted when it is the argmax, and the argmax is emitted
otherwise, token for token what plain decoding emits. Seeded rows draw from (seed, output
position) as in plain decoding.
"""
from __future__ import annotations

import numpy as np


def accept_drafts(target_tokens: np.ndarray, drafts: list[list[int]]
                  ) -> tuple[list[list[int]], np.ndarray]:
    """target_tokens: [E] the token sampled from the target distribution at each verified
    position, request after request, 1 + len(drafts[i]) positions for request i.
    Returns each request's emitted tokens (its accepted drafts, then the target token after them)
    and the [sum of emitted] indices into target_tokens of the emitted tokens."""
    if not any(drafts):  # plain decoding: every sampled token is emitted
        return [[t] for t in target_tokens.tolist()], np.arange(len(target_tokens))
    counts = np.fromiter((1 + len(d) for d in drafts), np.int64, len(drafts))  # [R]
    starts = np.cumsum(counts) - counts
    kmax = int(counts.max()) - 1
    draft_mat = np.full((len(drafts), kmax), -1, np.int64)  # [R, Kmax], -1 = padding
    for i, d in enumerate(drafts):
        draft_mat[i, :len(d)] = d
    cols = np.arange(draft_mat.shape[1])
    idx = np.minimum(starts[:, None] + cols, len(target_tokens) - 1)  # target at draft j
    match = (target_tokens[idx] == draft_mat) & (cols < counts[:, None] - 1)
    accepted = np.cumprod(match, axis=1).sum(axis=1)  # [R] leading matches
    emitted_counts = accepted + 1
    req_of = np.repeat(np.arange(len(drafts)), emitted_counts)
    emitted_idx = starts[req_of] + np.arange(int(emitted_counts.sum())) - np.repeat(
        np.cumsum(emitted_counts) - emitted_counts, emitted_counts)
    tokens = target_tokens[emitted_idx]
    bounds = np.cumsum(emitted_counts)[:-1]
    return [t.tolist() for t in np.split(tokens, bounds)], emitted_idx
