"""A request as the core sees it, and its state machine.

    WAITING ──schedule──▶ RUNNING ──stop / length / abort──▶ FINISHED_*
       ▲                    │
       └──── PREEMPTED ◀────┘  (blocks freed; recomputed when scheduled again)

Every state after PREEMPTED is a finished one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from octavo.params import LoRARequest, SamplingParams
from octavo.pooling_params import PoolingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # ends the request unless ignore_eos
    max_tokens: int  # resolved: never None in the core
    arrival_seq: int = 0  # FCFS order, assigned by the scheduler
    priority: int = 0  # lower is served first (under the scheduler's priority policy)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_sent_tokens: int = 0  # of its tokens, those the worker holds (sent in SchedulerOutputs)
    num_preemptions: int = 0
    num_prompt_logprobs_sent: int = 0  # prompt positions whose logprobs went out already
    arrival_time: float = 0.0  # wall clock, set by the front end
    first_scheduled_time: float | None = None  # wall clock, when it first left the waiting queue
    first_output_sent: bool = False
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    block_hashes: list[bytes] = field(default_factory=list)  # of each full block, chained
    num_cached_tokens: int | None = None  # prefix-cache hit when first scheduled
    stop_reason: int | str | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # the draft model's, for next step
    arrival_step: int = 0  # the scheduler's step count when it arrived (for aging)
    rank: int = 0  # the scheduler's fixed queue key from its policy (see scheduler.py)
    # bad_words as token sequences (the front end tokenizes them): the last token of each is
    # masked where the output so far ends with the others (structured.py applies it)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it runs with, else the base model
    # a pooling request: its prompt computed (whole in one step, or chunked, as
    # pooled_positions says: octavo.pooling_params.POOLED_POSITIONS), pooled, then done
    pooling_params: PoolingParams | None = None
    pooled_positions: str = "whole"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def take_unsent_tokens(self) -> list[int]:
        """The tokens appended since the worker last saw the request (for its next delta), now
        counted as sent. Only a running request's outputs are ever unsent: a new or resumed one
        is sent whole."""
        unsent = self.output_token_ids[self.num_sent_tokens - len(self.prompt_token_ids):]
        self.num_sent_tokens += len(unsent)
        return unsent

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def cache_extra_keys(self) -> tuple[object, ...]:
        """What besides its tokens makes its KV its own: an adapter changes every layer's
        keys and values, so blocks are shared only within one adapter (or none)."""
        salt = ("salt", self.cache_salt) if self.cache_salt is not None else ()
        lora = self.lora_request
        return salt if lora is None else (*salt, "lora", lora.lora_int_id, lora.lora_name)

    def sort_key(self) -> tuple[int, int]:
        """Queue order: the rank the scheduler's policy gave it (0 for all under fcfs), then
        arrival."""
        return (self.rank, self.arrival_seq)
