"""The token-budget step.

One rule: each request's `num_computed_tokens` chases its `num_tokens`. Every step serves running
requests first (a decode token each, or the next chunk of a long prompt), then admits waiting ones,
under one token budget (`max_num_batched_tokens`) and one sequence budget (`max_num_seqs`).
When blocks run out for a running request, the last running request in queue order (below) is
preempted: its blocks are freed and it goes back to the waiting queue, in its place, to be
recomputed later. A constrained request is skipped while its grammar compiles; its matcher
advances on every token it is given, and a grammar that has ended finishes it.

Queue order (`scheduling_policy`). fcfs, the default: arrival order; `priority` is ignored.
priority: lower `priority` values first (vLLM's convention), then arrival. Before a step
schedules anything, the first schedulable waiting request, if it lacks a seat (`max_num_seqs`)
or the KV blocks of a full-budget chunk, preempts running requests of strictly lower priority,
the lowest-priority latest first, until it would fit; none if even all of them would not make
room, and never one of equal or higher priority. (Before, so that no victim was scheduled: the
blocks a step allocates are hashed into the prefix cache at once. Blocks the running requests
then take may keep it out until the next step.) Aging, so that none starves: with N =
`priority_aging_steps` (0: off), a request's effective priority is its priority minus one for
every N steps since it arrived (waiting or running, so a preempted request keeps its place); a
waiting request preempts only running ones lower both as given and as aged, so a request that
has aged up to a stream of higher-priority arrivals is not preempted by them once it runs. Both
queues are ordered by priority - age / N, then arrival: the fixed key priority * N + arrival
step (`Request.rank`), so aging never changes a key and no queue is ever re-sorted.

Speculative decoding is the same rule: a decoding request is scheduled for 1 + its draft tokens
(n-gram: proposed here from its token ids; draft model: the ones the worker's draft model proposed
after the request's previous step); after verification, the positions of rejected drafts are given
back by moving `num_computed_tokens` back (their blocks stay in the table and are written again by
the next steps). Only real tokens are ever hashed into the prefix cache. A constrained request's
drafts are cut to the prefix its grammar accepts. With a draft model, a request that samples this
step also gets `lookahead` KV slots past its scheduled tokens: the draft model writes its own KV
there (its layers share the target's blocks) while it proposes the next drafts.

What the workers get is all they hold: a request they have not seen (new, or resumed after
preemption) whole, with its EOS ids; a running one as its new blocks, its computed count and the
tokens it was given since last scheduled (`Request.take_unsent_tokens`: a slice of its output,
O(tokens changed)). A rejected draft is never sent: only accepted tokens reach the workers.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np

from octavo.config import SchedulerConfig
from octavo.core.contract import (
    CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput, TopLogprobs)
from octavo.core.kv_manager import KVCacheManager, cdiv
from octavo.core.ngram import NgramProposer
from octavo.core.protocol import EngineCoreOutput, SchedulerStats
from octavo.core.request import Request, RequestStatus
from octavo.core.structured import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 structured: StructuredOutputManager | None = None,
                 proposer: NgramProposer | None = None, lookahead: int = 0,
                 max_loras: int = 0) -> None:
        """proposer: n-gram drafts; lookahead: > 0 when a draft model proposes (its
        num_speculative_tokens): drafts come in the worker's output, and slots for its KV;
        max_loras: the most adapters the running requests may use at once (the worker's
        slots), 0 without LoRA."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = kv
        self.structured = structured or StructuredOutputManager(None)
        self.requests: dict[str, Request] = {}
        self.priority_policy = config.scheduling_policy == "priority"
        self.aging_steps = config.priority_aging_steps if self.priority_policy else 0
        self.waiting: list[Request] = []  # sorted by Request.sort_key: (rank, arrival)
        self.running: list[Request] = []  # sorted the same: the tail is preempted first
        self._finished_ids: set[str] = set()
        self._arrivals = 0
        self.num_steps = 0  # schedule() calls so far: the clock of aging
        self.num_preemptions = 0
        self.peak_running = 0
        self.proposer = proposer
        self.lookahead = lookahead
        self.max_loras = max_loras
        self.spec_counts = [0, 0, 0]  # draft tokens, accepted, verifications
        self.expert_tokens: list[int] = []  # rows routed to each expert-parallel rank (cumulative)
        self.isolated: str | None = None  # set: a step schedules only this request (faults.py)
        # Requests of batches scheduled but whose output has not come back (pipeline stages
        # run several batches at once): never scheduled again, nor preempted, until it has.
        self.in_flight: set[str] = set()

    @property
    def speculating(self) -> bool:
        return self.proposer is not None or self.lookahead > 0

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if request.lora_id and not self.max_loras:  # it would wait for a slot forever
            raise ValueError(f"request {request.req_id!r} names a LoRA adapter, and this "
                             f"engine runs without LoRA")
        self.structured.add_request(request)  # starts its grammar's compile
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        request.arrival_step = self.num_steps
        if not self.priority_policy:
            request.rank = 0
        elif self.aging_steps:
            request.rank = request.priority * self.aging_steps + request.arrival_step
        else:
            request.rank = request.priority
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        """Abort the given requests in any state; returns the ids that were still unfinished."""
        aborted = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Abort the requests whose grammar failed to compile (the front end checks grammars
        first, so this is rare); the others whose compile finished become schedulable."""
        outputs = []
        for req_id, error in self.structured.collect_compiled():
            req = self.requests.get(req_id)
            if req is None:
                continue
            logger.error("request %s: structured_outputs grammar failed to compile: %s",
                         req_id, error)
            self.waiting.remove(req)
            req.stop_reason = f"structured_outputs: {error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(req_id, [], "abort", req.stop_reason))
        return outputs

    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage(),
                              self.num_preemptions, kv.prefix_queries, kv.prefix_hits,
                              kv.slots_allocated, kv.slots_unwritten, self.peak_running,
                              *self.spec_counts, list(self.expert_tokens))

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        isolated = self.isolated
        preempted = (self._preempt_for_priority() if self.priority_policy and isolated is None
                     else set())
        spec: dict[str, list[int]] = {}
        restores: dict[str, int] = {}
        self.kv.begin_step()

        i = 0
        preempted_running = False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if (isolated is not None and req.req_id != isolated) or req.req_id in self.in_flight:
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._propose(req, budget) if self.speculating else []
            num_new += len(drafts)
            extra = self._lookahead(req, req.num_computed_tokens + num_new)
            new_blocks = self.kv.allocate_slots(req, num_new + extra)
            while new_blocks is None:
                # The tail of `running` has not been scheduled yet this step (it is at or after i;
                # req itself is the last candidate).
                victim = self._pop_victim(num_scheduled)
                self._preempt(victim)
                preempted.add(victim.req_id)
                preempted_running = True
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new + extra)
            if new_blocks is None:
                break
            cached_reqs.append(CachedRequestData(req.req_id, new_blocks, req.num_computed_tokens,
                                                 req.take_unsent_tokens()))
            if drafts:
                spec[req.req_id] = drafts
            num_scheduled[req.req_id] = num_new
            budget -= num_new
            i += 1

        # Adapters in use: a waiting request of another adapter, when they fill the worker's
        # slots, waits (skipped, as for its grammar) until a running one's adapter is free.
        adapters = {r.lora_id for r in self.running if r.lora_id}
        idx = 0  # the first waiting request not skipped for its grammar
        while (not preempted_running and idx < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[idx]
            if (self.structured.is_compiling(req.req_id)
                    or (isolated is not None and req.req_id != isolated)
                    or req.req_id in self._finished_ids  # requeued: the worker forgets first
                    or (req.lora_id and req.lora_id not in adapters
                        and len(adapters) >= self.max_loras)):
                idx += 1
                continue
            if req.req_id in preempted:  # made room for those before it: it and the rest wait
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if (req.pooling_params is not None and req.pooled_positions == "whole"
                    and num_new < req.num_tokens):
                break  # an encoder's, pooled whole in one step: it waits for one with room
            extra = self._lookahead(req, num_hit + num_new)
            allocated = self.kv.allocate_slots(req, num_new + extra, hits)
            while allocated is None and isolated is not None and self._has_victim(num_scheduled):
                # A suspect run alone may need blocks that requests set aside for it hold
                # (a prefix they shared left the cache with the failed step): they make room.
                victim = self._pop_victim(num_scheduled)
                self._preempt(victim)
                preempted.add(victim.req_id)
                allocated = self.kv.allocate_slots(req, num_new + extra, hits)
            if allocated is None:
                break
            req.num_computed_tokens = num_hit
            restore = self.kv.state_restore(req, num_hit)
            if restore is not None:
                restores[req.req_id] = restore
            if req.num_cached_tokens is None:  # count a prompt's lookup once, not per resume
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_tokens, num_hit)
            self.waiting.pop(idx)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            bisect.insort(self.running, req, key=Request.sort_key)
            if req.lora_id:
                adapters.add(req.lora_id)
            self.peak_running = max(self.peak_running, len(self.running))
            token_ids = req.all_token_ids
            req.num_sent_tokens = len(token_ids)
            new_reqs.append(NewRequestData(
                req.req_id, token_ids, req.num_prompt_tokens, req.sampling_params,
                list(self.kv.blocks_of(req.req_id)), req.num_computed_tokens,
                sorted(req.eos_token_ids), req.lora_request, req.pooling_params))
            num_scheduled[req.req_id] = num_new
            budget -= num_new

        saves: dict[str, list[tuple[int, int]]] = {}
        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            if req_id not in spec and (planned := self.kv.plan_state_saves(
                    req, req.num_computed_tokens, n)):
                saves[req_id] = planned
            req.num_computed_tokens += n
            req.draft_token_ids = []  # used now, or stale: the worker proposes again
        self.in_flight.update(num_scheduled)
        finished, self._finished_ids = self._finished_ids, set()
        self.num_steps += 1
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                               self.max_num_batched_tokens - budget, finished, preempted,
                               spec_token_ids=spec, state_restores=restores,
                               state_saves=saves)

    def _has_victim(self, scheduled: dict[str, int]) -> bool:
        return any(r.req_id not in self.in_flight and r.req_id not in scheduled
                   for r in self.running)

    def _pop_victim(self, scheduled: dict[str, int]) -> Request:
        """The last running request neither in flight nor scheduled in this step."""
        for j in range(len(self.running) - 1, -1, -1):
            req = self.running[j]
            if req.req_id not in self.in_flight and req.req_id not in scheduled:
                return self.running.pop(j)
        raise AssertionError("no running request to preempt")  # callers check first

    def resend_dropped(self, req_ids: set[str]) -> None:
        """A step that raised may not have reached the worker: the finished and preempted
        requests it told the worker to drop are told again with the next step."""
        self._finished_ids |= req_ids

    def requeue(self, req_ids: list[str]) -> None:
        """After a step that raised: these requests go back to waiting, to be recomputed from
        scratch (the worker forgets them), and no block of theirs stays findable in the prefix
        cache (this step's writes to them may be half done)."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            self.kv.uncache(req_id)
            self.running.remove(req)
            self._preempt(req)
            self._finished_ids.add(req_id)

    def fail(self, req_id: str, reason: str) -> EngineCoreOutput | None:
        """Abort one request for an error of its own; its error output, or None if gone."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        self.kv.uncache(req_id)
        (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
        req.stop_reason = reason
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutput(req_id, [], "abort", reason)

    def effective_priority(self, req: Request) -> int:
        """Its priority, minus one for every `priority_aging_steps` steps since it arrived."""
        if not self.aging_steps:
            return req.priority
        return req.priority - (self.num_steps - req.arrival_step) // self.aging_steps

    def _preempt_for_priority(self) -> set[str]:
        """Under the priority policy, before anything is scheduled: if the first schedulable
        waiting request lacks a seat or the blocks of a full-budget chunk, preempt running
        requests of strictly lower priority (as given and as aged), from the tail of `running`
        (lowest rank, latest), until it would fit; none if even all of them would not do."""
        head = next((r for r in self.waiting if not self.structured.is_compiling(r.req_id)), None)
        if head is None or not self.running:
            return set()
        eff = self.effective_priority(head)
        victims = [r for r in reversed(self.running)
                   if r.priority > head.priority and self.effective_priority(r) > eff
                   and r.req_id not in self.in_flight]
        if not victims:
            return set()
        kv, pool = self.kv, self.kv.pool
        hits, num_hit = kv.get_computed_blocks(head)
        end = num_hit + min(head.num_tokens - num_hit, self.max_num_batched_tokens)
        needed = cdiv(end + self._lookahead(head, end), kv.block_size) - len(hits)
        free = pool.num_free_blocks
        seats = self.max_num_seqs - len(self.running)
        drops: dict[int, int] = {}  # block -> references the chosen victims hold on it

        def fits() -> bool:
            # As KVCacheManager.allocate_slots: an idle (unreferenced) hit is taken off the
            # free blocks when it is reused.
            idle = sum(1 for b in hits if pool.ref_counts[b] == drops.get(b, 0))
            return seats > 0 and needed + idle <= free

        if fits():
            return set()
        chosen = []
        for victim in victims:
            chosen.append(victim)
            seats += 1
            table = kv.blocks_of(victim.req_id)
            for b in table[len(table) - kv.num_held_blocks(victim.req_id):]:
                drops[b] = drops.get(b, 0) + 1
                if drops[b] == pool.ref_counts[b]:
                    free += 1
            if fits():
                break
        else:
            return set()
        for victim in chosen:
            self.running.remove(victim)
            self._preempt(victim)
        return {v.req_id for v in chosen}

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: as many as the budget, max_tokens and
        max_model_len leave room for after its one certain token; for a constrained request,
        the prefix its grammar accepts."""
        if req.num_computed_tokens != req.num_tokens - 1:
            return []
        room = min(budget, req.max_tokens - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens) - 1
        if room <= 0:
            return []
        if self.proposer is not None:
            drafts = self.proposer.propose(req.all_token_ids, room)
        else:
            drafts = req.draft_token_ids[:room]
        if drafts and req.sampling_params.structured_outputs is not None:
            drafts = self.structured.valid_prefix(req.req_id, drafts)
        return drafts

    def _lookahead(self, req: Request, end: int) -> int:
        """KV slots past `end` (the scheduled tokens' end) for the draft model: it writes the
        token sampled this step and its drafts but the last (within max_model_len). None unless
        the request samples this step."""
        if not self.lookahead or end < req.num_tokens:
            return 0
        return max(0, min(self.lookahead, self.max_model_len - end))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.draft_token_ids = []  # the worker forgets the request, and its draft state
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def batch_landed(self, sched: SchedulerOutput) -> None:
        """A batch's output came back (or its step failed): its requests may be scheduled."""
        self.in_flight.difference_update(sched.num_scheduled_tokens)

    def count_expert_tokens(self, per_rank: list[int]) -> None:
        """Add a step's rows per expert-parallel rank to the running count."""
        if per_rank:
            if not self.expert_tokens:
                self.expert_tokens = [0] * len(per_rank)
            self.expert_tokens = [a + b for a, b in zip(self.expert_tokens, per_rank)]

    def update_from_output(self, sched: SchedulerOutput, out: ModelOutput) -> list[EngineCoreOutput]:
        self.batch_landed(sched)
        self.count_expert_tokens(out.expert_tokens)
        outputs = []
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if req.pooling_params is not None:
                if req_id in out.pooled:  # else a chunk of its prompt, not the last
                    outputs.append(self._finish_pooled(req, out.pooled[req_id]))
                continue
            num_drafts = len(sched.spec_token_ids.get(req_id, ()))
            if num_drafts:  # give back the positions of the rejected drafts
                accepted = len(sampled) - 1
                req.num_computed_tokens -= num_drafts - accepted
                self.spec_counts[0] += num_drafts
                self.spec_counts[1] += accepted
                self.spec_counts[2] += 1
            new_tokens: list[int] = []
            status = None
            for tok in sampled:
                req.output_token_ids.append(tok)
                new_tokens.append(tok)
                status = self._check_grammar(req, tok) or self._check_stop(req, tok)
                if status is not None:
                    break
            prompt_lp = self._new_prompt_logprobs(req, sched, out.prompt_logprobs.get(req_id))
            if not new_tokens and prompt_lp is None:
                continue
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            else:
                req.draft_token_ids = out.draft_token_ids.get(req_id, [])
            outputs.append(EngineCoreOutput(
                req_id, new_tokens, status.finish_reason if status else None,
                req.stop_reason, out.logprobs.get(req_id), prompt_lp,
                num_cached_tokens=req.num_cached_tokens or 0,
                first_scheduled_time=None if req.first_output_sent else req.first_scheduled_time))
            req.first_output_sent = True
        return outputs

    def _finish_pooled(self, req: Request, pooled: np.ndarray) -> EngineCoreOutput:
        """A pooling request's prompt is done: its pooled output is its output."""
        self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(req.req_id, [], "stop",
                                num_cached_tokens=req.num_cached_tokens or 0,
                                first_scheduled_time=req.first_scheduled_time, pooled=pooled)

    @staticmethod
    def _new_prompt_logprobs(req: Request, sched: SchedulerOutput,
                             lp: TopLogprobs | None) -> TopLogprobs | None:
        """Drop the positions already sent before a preemption made the worker recompute them."""
        if lp is None:
            return None
        first = req.num_computed_tokens - sched.num_scheduled_tokens[req.req_id]
        skip = max(0, req.num_prompt_logprobs_sent - first)
        req.num_prompt_logprobs_sent = max(req.num_prompt_logprobs_sent, first + len(lp.ranks))
        if skip >= len(lp.ranks):
            return None
        if skip:
            lp = lp.select(slice(skip, None))
        return lp

    def _check_grammar(self, req: Request, token: int) -> RequestStatus | None:
        refusal = self.structured.refusal(req, token)
        if refusal is not None:  # only after a step whose mask left nothing to sample
            req.stop_reason = refusal
            return RequestStatus.FINISHED_ABORTED
        accepted = self.structured.accept(req.req_id, token)
        if accepted is None:
            return None
        if not accepted:  # the bitmask never allows it: a bug, so stop the request, not the loop
            req.stop_reason = f"token {token} is outside the structured_outputs grammar"
            return RequestStatus.FINISHED_ABORTED
        if self.structured.is_terminated(req.req_id):
            return RequestStatus.FINISHED_STOPPED  # also with ignore_eos: nothing may follow
        return None

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if len(req.output_token_ids) >= params.min_tokens:  # the sampler masks stops before
            if token in req.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.structured.remove(req.req_id)
        self.kv.free(req)
        del self.requests[req.req_id]
        self._finished_ids.add(req.req_id)
