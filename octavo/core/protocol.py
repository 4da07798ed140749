"""The messages that cross between the front end and the engine core: the only core types the
front end may import (a contract in pyproject.toml holds it to that; the other is the entry point
that builds a core, `engine_core.create_engine_core`, called only by the core's two hosts).

In: `EngineCoreRequest` (one sequence to generate; the front end fans n > 1 out into n of them),
`AbortRequests`, `UtilityCall`, `Shutdown`, `Wake` (replicas in lockstep). Out: one
`CoreOutputs` per step, with each changed request's `EngineCoreOutput` and the scheduler's
`SchedulerStats`. The core turns a request into
its own mutable `Request` (core/request.py) and keeps it; nothing the front end holds is ever
the core's state.

They are msgspec structs: a core in another process gets them as msgpack over ZeroMQ
(engine/messages.py is the codec; the numpy arrays in `TopLogprobs` travel as raw bytes, never
pickled), a core in the caller's process as they are. Torch-free, like all of the core.
"""
from __future__ import annotations

import msgspec
import numpy as np

from octavo.core.contract import TopLogprobs
from octavo.params import LoRARequest, SamplingParams
from octavo.pooling_params import PoolingParams

__all__ = ["AbortRequests", "CoreInput", "CoreOutputs", "EngineCoreOutput", "EngineCoreRequest",
           "SchedulerStats", "Shutdown", "TopLogprobs", "UtilityCall", "Wake"]

# TopLogprobs is the worker's type (core/contract.py), carried to the front end unchanged: it is
# listed here so that the front end reads it from the protocol.


class EngineCoreRequest(msgspec.Struct, tag=True, frozen=True):
    """One sequence to generate, validated and tokenized by the front end."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # validated again when decoded (its __post_init__)
    eos_token_ids: frozenset[int]  # end the request unless sampling_params.ignore_eos
    max_tokens: int  # resolved by the front end: never None here
    arrival_time: float  # wall clock, when the front end built it
    priority: int = 0  # lower is served first (under the scheduler's priority policy)
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    # bad_words as token sequences (the front end tokenizes them; the core masks the last
    # token of each where the output so far ends with the others)
    bad_words_token_ids: list[list[int]] = []
    lora_request: LoRARequest | None = None  # checked by the front end (octavo/lora/adapter.py)
    # a pooling request (an embedding): its prompt is pooled, nothing generated
    pooling_params: PoolingParams | None = None
    pooled_positions: str = "whole"  # a pooling request's: POOLED_POSITIONS


class AbortRequests(msgspec.Struct, tag=True):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str  # "stats" or "reset_prefix_cache"


class Shutdown(msgspec.Struct, tag=True):
    pass


class Wake(msgspec.Struct, tag=True):
    """Nothing for this core, but another replica in lockstep has news: join the next round
    now rather than at the idle poll's end (distributed/lockstep.py)."""


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown | Wake


# The per-step structs are arrays on the wire (both ends run the same code): no field names
# repeated for every request of every step. gc=False: one is made per request per step, and
# none is ever part of a reference cycle.
class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # on a request's first output only
    pooled: np.ndarray | None = None  # a pooling request's vector (float32), with its finish


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, found cached
    kv_slots_allocated: int = 0  # slots held by finished block tables (cumulative)
    kv_slots_unwritten: int = 0  # of those, never written
    peak_running: int = 0
    spec_draft_tokens: int = 0  # draft tokens proposed and verified (cumulative)
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_num_drafts: int = 0  # verifications (request-steps with drafts)
    # expert parallelism: rows routed to each rank's experts (cumulative; empty without it)
    expert_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification (accepted drafts + the one sampled after them)."""
        if not self.spec_num_drafts:
            return None
        return 1 + self.spec_accepted_tokens / self.spec_num_drafts


class CoreOutputs(msgspec.Struct):
    """One step's outputs (none, when only the stats or a utility call's answer changed)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    utility_call_id: int | None = None
    utility_result: SchedulerStats | bool | None = None
    utility_error: str | None = None
