"""The only types that cross between the core and the workers.

SchedulerOutput is diff-shaped: a request the worker has not seen (new, or resumed after
preemption) arrives in full, with its EOS ids; a running one arrives as a delta, with the tokens
the core appended to it since the worker last saw it. A worker's token state is built from these
alone, never from what it sampled, so every rank (tensor-parallel peers, earlier pipeline stages
that do not sample) stays in step. ModelOutput carries back only the sampled token ids and the
logprobs that were asked for, as numpy arrays; one rank returns it. A step with constrained
requests (a grammar, allowed_token_ids, bad_words) also carries their token bitmask (numpy; the
worker turns it into a tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from octavo.params import LoRARequest, SamplingParams
from octavo.pooling_params import PoolingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + output so far (non-empty output only when resumed)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int]  # the request's own; the worker masks them under min_tokens
    lora_request: LoRARequest | None = None  # its adapter (the worker loads it), else None
    # a pooling request: its prompt, whole in this step, is pooled instead of sampled from
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Appended since the worker last saw the request: the tokens the core accepted from the
    # steps since (a step's sampled token, or its accepted drafts and the token after them).
    new_token_ids: list[int]


@dataclass(slots=True)
class GrammarBitmask:
    """Tokens the constrained requests that sample this step may emit (their grammar's tokens
    intersected with their token mask, core/token_mask.py): row i belongs to request
    req_ids[i], which may emit token t there when bit t % 32 of bitmask[i, t // 32] is set. A
    request with draft tokens has one row per verified position, in order (its id repeats)."""

    req_ids: list[str]
    bitmask: np.ndarray  # [len(req_ids), ceil(vocab_size / 32)] int32


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step, in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # worker drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    grammar: GrammarBitmask | None = None  # filled by the core after scheduling
    # Speculative decoding: request id -> draft tokens, scheduled right after its last token
    # (num_scheduled_tokens counts them); the worker verifies them and returns 1 + accepted tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Linear-attention layers' saved states (core/state_checkpoints.py): request id -> the slot
    # a new request's states start from (its cached prefix ends there); request id -> (tokens
    # into its step, slot) where its states are saved during the step.
    state_restores: dict[str, int] = field(default_factory=dict)
    state_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], [], {}, 0)


@dataclass(slots=True)
class TopLogprobs:
    """Logprobs for a run of positions: column 0 is the chosen token, columns 1.. the top-k (or
    a request's logprob_token_ids, whose ranks are then in token_ranks)."""

    token_ids: np.ndarray  # [num_positions, 1 + k] int64
    logprobs: np.ndarray  # [num_positions, 1 + k] float32
    ranks: np.ndarray  # [num_positions] int64, rank of the chosen token (1 = most likely)
    # [num_positions, 1 + k] int64, every column's rank; None: column c > 0 is rank c (top-k)
    token_ranks: np.ndarray | None = None

    def select(self, positions: np.ndarray | slice, width: int | None = None) -> TopLogprobs:
        """These positions (rows), their first `width` columns (None: all)."""
        cols = slice(None) if width is None else slice(0, width)
        ranks = None if self.token_ranks is None else self.token_ranks[positions, cols]
        return TopLogprobs(self.token_ids[positions, cols], self.logprobs[positions, cols],
                           self.ranks[positions], ranks)

    def rank(self, position: int, column: int) -> int:
        if column == 0:
            return int(self.ranks[position])
        return column if self.token_ranks is None else int(self.token_ranks[position, column])


@dataclass
class ModelOutput:
    req_ids: list[str]
    # Empty: a prefill chunk that did not reach the end; with drafts, the accepted ones and the
    # token sampled after them.
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    # Draft-model speculation: request id -> the draft model's tokens to follow this step's last
    # one, to be verified in a later step (their KV slots are the scheduler's lookahead).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Expert parallelism: the rows routed to each rank's experts this step, over the output
    # rank's MoE layers (empty without it).
    expert_tokens: list[int] = field(default_factory=list)
    # pooling requests: request id -> its pooled vector (float32)
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
