"""Torch-free stand-ins for the worker side, shared by the core tests.

`FakeWorker` mirrors what the model runner keeps per request (token ids, computed count, block
table), built only from the diff-shaped SchedulerOutput (a running request's new tokens come in
its delta, never from what the fake sampled), and checks the contract as it goes. It samples a
token for a request exactly when the scheduled chunk reaches the end of its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from octavo.config import SchedulerConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.kv_manager import KVCacheManager
from octavo.core.request import Request
from octavo.core.scheduler import EngineCoreOutput, Scheduler
from octavo.params import SamplingParams

EOS = 2
STOP = 7  # used as a stop_token_id by the tests


def token_at(index: int) -> int:
    """The default output token at output position `index`: never EOS nor STOP."""
    return 1000 + index


def make_request(req_id: str, prompt_len: int, max_tokens: int = 16, priority: int = 0,
                 **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    prompt = [100 + (i % 500) for i in range(prompt_len)]
    return Request(req_id, prompt, sp, frozenset({EOS}), max_tokens, priority=priority)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int | None = None,
                   enable_caching: bool = False, scheduling_policy: str = "fcfs",
                   priority_aging_steps: int = 0, max_loras: int = 0) -> Scheduler:
    if max_model_len is None:
        max_model_len = num_blocks * block_size
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     scheduling_policy=scheduling_policy,
                                     priority_aging_steps=priority_aging_steps),
                     KVCacheManager(num_blocks, block_size, enable_caching), max_model_len,
                     max_loras=max_loras)


# (req_id, output index) -> token id
TokenFn = Callable[[str, int], int]


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    sampling_params: SamplingParams = field(repr=False)
    sampled: list[int] = field(default_factory=list)  # sampled, not yet sent back in a delta


class FakeWorker:
    def __init__(self, block_size: int, token_fn: TokenFn | None = None) -> None:
        self.block_size = block_size
        self.token_fn = token_fn or (lambda req_id, index: token_at(index))
        self.reqs: dict[str, _WorkerRequest] = {}
        self.num_calls = 0

    def drop(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    def apply(self, sched: SchedulerOutput) -> None:
        """Update per-request state from a SchedulerOutput, checking the worker contract."""
        self.num_calls += 1
        assert not (sched.finished_req_ids & set(sched.num_scheduled_tokens))
        assert not (sched.preempted_req_ids & set(sched.num_scheduled_tokens))
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.drop(req_id)
        for new in sched.new_requests:
            assert new.req_id not in self.reqs, f"{new.req_id} sent in full twice"
            assert 0 < new.num_prompt_tokens <= len(new.token_ids)
            assert new.eos_token_ids, f"{new.req_id} sent without its EOS ids"
            self.reqs[new.req_id] = _WorkerRequest(
                list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                list(new.block_ids), new.sampling_params)
        for cached in sched.cached_requests:
            assert cached.req_id in self.reqs, f"delta for unknown request {cached.req_id}"
            state = self.reqs[cached.req_id]
            assert state.num_computed == cached.num_computed_tokens
            # The core sends back what it kept of the sampled tokens (all of it, as it runs on).
            assert cached.new_token_ids == state.sampled, cached.req_id
            state.token_ids.extend(cached.new_token_ids)
            state.sampled = []
            state.block_ids.extend(cached.new_block_ids)
        # Batch order: the running requests first, then the newly admitted ones.
        assert list(sched.num_scheduled_tokens) == (
            [c.req_id for c in sched.cached_requests] + [n.req_id for n in sched.new_requests])
        assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.apply(sched)
        req_ids, sampled = [], []
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            assert n >= 1
            state.num_computed += n
            assert state.num_computed <= len(state.token_ids) and not state.sampled
            # Every computed token has a KV slot.
            assert len(state.block_ids) * self.block_size >= state.num_computed
            req_ids.append(req_id)
            if state.num_computed == len(state.token_ids):
                tok = self.token_fn(req_id, len(state.token_ids) - state.num_prompt_tokens)
                state.sampled = [tok]
                sampled.append([tok])
            else:
                sampled.append([])  # a prefill chunk that did not reach the end
        return ModelOutput(req_ids, sampled)


def simple_model_output(scheduler: Scheduler, sched: SchedulerOutput,
                        token_fn: TokenFn | None = None) -> ModelOutput:
    """The worker in one line: a token only for requests whose prefill reached the end."""
    token_fn = token_fn or (lambda req_id, index: token_at(index))
    req_ids = list(sched.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        if req.num_computed_tokens >= req.num_tokens:
            sampled.append([token_fn(req_id, len(req.output_token_ids))])
        else:
            sampled.append([])
    return ModelOutput(req_ids, sampled)


def step(scheduler: Scheduler, token_fn: TokenFn | None = None
         ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    sched = scheduler.schedule()
    return sched, scheduler.update_from_output(
        sched, simple_model_output(scheduler, sched, token_fn))


def run_to_completion(scheduler: Scheduler, token_fn: TokenFn | None = None,
                      max_steps: int = 10_000) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, outs = step(scheduler, token_fn)
        for o in outs:
            outputs.setdefault(o.req_id, []).append(o)
    raise AssertionError("requests did not finish")
