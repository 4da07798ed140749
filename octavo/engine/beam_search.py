"""Beam search at the front end, as vLLM v1 does it: each step, every running beam of every prompt
is one ordinary core request for a single greedy token with the top-k logprobs of that position,
and all of them are submitted together, so they run in one engine step. A beam's request is its
prompt plus its tokens; beams share the full blocks of their common prefix through the prefix
cache (a fork is a reference count, not a copy), so a step computes little more than each beam's
unfinished last block. Without prefix caching the result is the same, only slower.

The selection follows transformers' `generate(num_beams=W, do_sample=False)` exactly:
- the top K = max(2, 1 + number of EOS ids) * W continuations over all running beams, by
  cumulative logprob (K, so that at least W of them do not end);
- of those, the first W that end (an EOS id, or max_tokens reached) may enter the finished set,
  scored cumulative logprob / generated_length ** length_penalty (EOS counted); the set keeps W;
- the best W that do not end are the next running beams;
- the search stops when every continuation ends, or once W beams have finished and either
  early_stopping is True, or no running beam can beat the worst finished one (its score divided
  by the current length ** length_penalty; by max_tokens ** length_penalty with
  early_stopping="never" and length_penalty > 0).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from octavo.inputs import unwrap_prompt
from octavo.params import (
    BeamSearchOutput, BeamSearchParams, BeamSearchSequence, CompletionOutput, Logprob,
    LoRARequest, RequestOutput, SamplingParams)

if TYPE_CHECKING:
    from octavo.engine.async_engine import AsyncEngine
    from octavo.engine.llm_engine import LLMEngine

# One running beam's next-token candidates: (token id, logprob), best first.
TopTokens = list[tuple[int, float]]


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # generated so far
    logprob: float  # cumulative
    score: float = 0.0  # finished beams: logprob / len(tokens) ** length_penalty
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # each step's candidates


@dataclass
class BeamSearch:
    """The search for one prompt; `advance` takes the running beams' top tokens each step."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: BeamSearchParams
    eos_ids: frozenset[int]
    running: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    finished: list[Beam] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # every beam runs with this adapter

    def __post_init__(self) -> None:
        if self.params.ignore_eos:
            self.eos_ids = frozenset()

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_ids)) * self.params.beam_width

    def advance(self, tops: Sequence[TopTokens]) -> None:
        """tops[i]: at least `num_candidates` next tokens of running beam i (or all there are)."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        length = len(self.running[0].tokens) + 1
        cands = sorted(((beam.logprob + lp, i, tok) for i, beam in enumerate(self.running)
                        for tok, lp in tops[i]), key=lambda c: -c[0])[:self.num_candidates]
        at_limit = length >= self.params.max_tokens
        ends = [at_limit or tok in self.eos_ids for _, _, tok in cands]
        steps = [{tok: Logprob(lp, rank) for rank, (tok, lp) in enumerate(top, 1)}
                 for top in tops]

        def child(i: int, tok: int, lp: float, score: float = 0.0) -> Beam:
            parent = self.running[i]
            return Beam(parent.tokens + [tok], lp, score, parent.logprobs + [steps[i]])

        # Only the first `width` candidates may finish; the rest are there to keep W running.
        for (lp, i, tok), end in zip(cands[:width], ends):
            if end:
                self.finished.append(child(i, tok, lp, lp / length ** penalty))
        self.finished.sort(key=lambda b: -b.score)  # stable: earlier finishers win ties
        del self.finished[width:]
        self.running = [child(i, tok, lp)
                        for (lp, i, tok), end in zip(cands, ends) if not end][:width]
        if all(ends) or not self.running:
            self.done = True
        elif len(self.finished) == width:
            if self.params.early_stopping is True:
                self.done = True
            else:
                best_len = (self.params.max_tokens if self.params.early_stopping == "never"
                            and penalty > 0 else length)
                self.done = not self.running[0].logprob / best_len ** penalty \
                    > self.finished[-1].score

    def _best(self) -> list[Beam]:
        return self.finished or sorted(self.running, key=lambda b: -b.logprob)

    def sequences(self, tokenizer) -> BeamSearchOutput:
        """vLLM's shape: every beam with the prompt's tokens and text, best first."""
        seqs = []
        for beam in self._best():
            ended = bool(beam.tokens) and beam.tokens[-1] in self.eos_ids
            tokens = self.prompt_ids + beam.tokens
            seqs.append(BeamSearchSequence(tokens, list(beam.logprobs), beam.logprob,
                                           tokenizer.decode(tokens, skip_special_tokens=True),
                                           "stop" if ended else "length"))
        return BeamSearchOutput(seqs)

    def output(self, tokenizer, num: int | None = None) -> RequestOutput:
        """The best `num` (default: all) finished beams as completions, best first."""
        beams = self._best()
        outs = []
        for i, beam in enumerate(beams[:num]):
            ended = bool(beam.tokens) and beam.tokens[-1] in self.eos_ids
            text_ids = beam.tokens[:-1] if ended else beam.tokens
            outs.append(CompletionOutput(i, tokenizer.decode(text_ids, skip_special_tokens=True),
                                         list(beam.tokens), beam.logprob, None,
                                         "stop" if ended else "length"))
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, None, outs, True)


def start(engine, request_id: str, prompt, params: BeamSearchParams,
          cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> BeamSearch:
    """Tokenize and check one prompt (`engine`: LLMEngine or AsyncEngine)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    processor = engine.processor
    processor.limits.check_width("beam width (n, or best_of)", params.beam_width)
    if 2 * params.beam_width > processor.vocab_size:  # each step ranks 2 x width candidates
        raise ValueError(f"beam_width must be <= half the vocabulary "
                         f"({processor.vocab_size // 2}), got {params.beam_width}")
    body, own_salt = unwrap_prompt(prompt)
    text, ids = processor.tokenize(body)
    processor.validate(ids, SamplingParams(max_tokens=params.max_tokens))
    if lora_request is not None:
        processor.adapters.check(lora_request)
    return BeamSearch(request_id, text, ids, params, engine.processor.eos_token_ids,
                      cache_salt=own_salt or cache_salt, lora_request=lora_request)


def _step_params(search: BeamSearch) -> SamplingParams:
    # One greedy token; EOS must not end anything early or change the logprobs.
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          logprobs=search.num_candidates, skip_special_tokens=False)


def _top_tokens(out: RequestOutput, k: int) -> TopTokens:
    position = out.outputs[0].logprobs[0]
    ranked = sorted(((tok, lp.logprob) for tok, lp in position.items()), key=lambda t: -t[1])
    return ranked[:k]


def run(engine: LLMEngine, searches: list[BeamSearch]) -> None:
    """Drive the searches to the end on the synchronous engine: per step, every running beam
    of every search is one request, all added before the engine steps."""
    waiting: set[str] = set()
    try:
        while True:
            live = [s for s in searches if not s.done]
            if not live:
                return
            pending: dict[str, tuple[BeamSearch, int]] = {}
            for s in live:
                params = _step_params(s)
                for i, beam in enumerate(s.running):
                    rid = f"beam-{engine.next_request_id()}"
                    engine.add_request(rid, s.prompt_ids + beam.tokens, params,
                                       cache_salt=s.cache_salt, max_logprobs=s.num_candidates,
                                       lora_request=s.lora_request)
                    pending[rid] = (s, i)
                    waiting.add(rid)
            tops: dict[int, list[TopTokens | None]] = {id(s): [None] * len(s.running)
                                                       for s in live}
            while waiting:
                for out in engine.step():
                    if out.finished and out.request_id in waiting:
                        waiting.discard(out.request_id)
                        s, i = pending[out.request_id]
                        tops[id(s)][i] = _top_tokens(out, s.num_candidates)
            for s in live:
                s.advance(tops[id(s)])
    except BaseException:
        for rid in waiting:
            engine.abort_request(rid)
        raise


async def run_async(engine: AsyncEngine, searches: list[BeamSearch], priority: int = 0) -> None:
    """The same on the server's engine: each step's requests are admitted together, so the
    core schedules them in one step. Cancelling the task aborts the step's requests."""
    step = 0
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            return
        prepared, owners = [], []
        for s in live:
            params = _step_params(s)
            for i, beam in enumerate(s.running):
                prepared.append(engine.prepare(
                    f"{s.request_id}-beam{step}.{i}", s.prompt_ids + beam.tokens, params,
                    priority, s.cache_salt, max_logprobs=s.num_candidates,
                    lora_request=s.lora_request))
                owners.append((s, i))
        streams = engine.generate_all(prepared)
        finals = await asyncio.gather(*(_last(st) for st in streams))
        tops: dict[int, list[TopTokens | None]] = {id(s): [None] * len(s.running) for s in live}
        for (s, i), out in zip(owners, finals):
            tops[id(s)][i] = _top_tokens(out, s.num_candidates)
        for s in live:
            s.advance(tops[id(s)])
        step += 1


async def _last(stream) -> RequestOutput:
    """The request's one token: the stream's outputs are deltas, the token comes in one."""
    got = None
    async for out in stream:
        if out.outputs and out.outputs[0].logprobs:
            got = out
    if got is None:
        raise RuntimeError("a beam's request ended without a token (aborted)")
    return got
