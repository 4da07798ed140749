"""Turn the core's per-step token outputs into RequestOutputs: text, logprobs, finish reasons.

A request with n > 1 was fanned out into n core requests (children); their completions are
gathered back into one RequestOutput under the parent's id. With best_of > n, best_of children
run and only the n with the highest cumulative logprob come out, whole, once all have finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from octavo.core.protocol import EngineCoreOutput, TopLogprobs
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.processor import PreparedRequest
from octavo.params import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, SamplingParams
from octavo.pooling_params import PoolingOutput, PoolingRequestOutput


@dataclass
class ChildState:
    index: int
    detok: IncrementalDetokenizer | None  # None: detokenize=False, token ids only
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_text: str = ""  # the delta produced by the latest step
    num_sent: int = 0  # tokens already handed out as deltas

    def completion(self, delta: bool) -> CompletionOutput:
        if not delta:
            text = self.detok.text if self.detok is not None else ""
            return CompletionOutput(self.index, text, list(self.token_ids),
                                    self.cumulative_logprob, self.logprobs, self.finish_reason,
                                    self.stop_reason)
        start, self.num_sent = self.num_sent, len(self.token_ids)
        text, self.new_text = self.new_text, ""
        logprobs = None if self.logprobs is None else self.logprobs[start:]
        return CompletionOutput(self.index, text, self.token_ids[start:], self.cumulative_logprob,
                                logprobs, self.finish_reason, self.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    pooling: bool = False  # a pooling request: its output is its vector
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())

    def output(self, delta: bool = False) -> RequestOutput | PoolingRequestOutput:
        if self.pooling:
            data = self.pooled if self.pooled is not None else np.zeros(0, np.float32)
            return PoolingRequestOutput(self.request_id, PoolingOutput(data),
                                        self.prompt_token_ids, self.finished)
        n = self.params.n
        if len(self.children) > n:  # best_of: nothing until every sample is done
            outs = []
            if self.finished:
                ranked = sorted(self.children.values(), key=lambda c: -c.cumulative_logprob)
                outs = [c.completion(False) for c in ranked[:n]]
                for i, out in enumerate(outs):
                    out.index = i
        else:
            outs = [c.completion(delta) for c in self.children.values()]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             self.prompt_logprobs, outs, self.finished, self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.parent_of: dict[str, str] = {}  # child (core) request id -> parent id

    def add_request(self, prepared: PreparedRequest) -> None:
        params = prepared.params
        want_lp = params.logprobs is not None
        ranked = params.num_samples > params.n  # best_of ranks by cumulative logprob
        children = {
            cid: ChildState(i, IncrementalDetokenizer(self.tokenizer, prepared.prompt_token_ids,
                                                      params) if params.detokenize else None,
                            logprobs=[] if want_lp else None,
                            cumulative_logprob=0.0 if want_lp or ranked else None)
            for i, cid in enumerate(prepared.child_ids)}
        parent = ParentState(prepared.request_id, prepared.prompt, prepared.prompt_token_ids,
                             params, children, pooling=prepared.pooling)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[prepared.request_id] = parent
        for cid in children:
            self.parent_of[cid] = prepared.request_id

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def abort(self, request_id: str, delta: bool = False) -> RequestOutput | None:
        """Mark every unfinished child aborted and drop the request; returns its final output
        (with `delta`, only what was not sent yet)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for cid, child in parent.children.items():
            self.parent_of.pop(cid, None)
            if child.finish_reason is None:
                child.finish_reason = "abort"
        return parent.output(delta)

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[ParentState], list[str]]:
        """Apply one step. Returns the parents that changed, and children to abort in the core
        (they hit a stop string)."""
        changed: dict[str, ParentState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent_id = self.parent_of.get(out.req_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[out.req_id]
            if out.first_scheduled_time is not None and parent.first_scheduled_time is None:
                parent.first_scheduled_time = out.first_scheduled_time
                parent.num_cached_tokens = out.num_cached_tokens
            if out.pooled is not None:
                parent.pooled = out.pooled
            if out.prompt_logprobs is not None and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(self._positions(out.prompt_logprobs,
                                                              parent.params.detokenize))
            if child.finish_reason is None:
                self._apply(child, parent.params, out, to_abort)
            changed[parent_id] = parent
        for parent in changed.values():
            if parent.finished:
                del self.parents[parent.request_id]
                for cid in parent.children:
                    self.parent_of.pop(cid, None)
        return list(changed.values()), to_abort

    def _apply(self, child: ChildState, params: SamplingParams, out: EngineCoreOutput,
               to_abort: list[str]) -> None:
        child.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and child.cumulative_logprob is not None:
            if child.logprobs is not None:
                child.logprobs.extend(self._positions(out.logprobs, params.detokenize))
            child.cumulative_logprob += float(out.logprobs.logprobs[:, 0].sum())
        if child.detok is None:  # token ids only: no text, no stop strings (refused)
            if out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            return
        text_tokens = out.new_token_ids
        ended_by_token = out.finish_reason == "stop" and out.new_token_ids
        if ended_by_token and not params.include_stop_str_in_output:
            text_tokens = text_tokens[:-1]  # the eos / stop token itself is not text
        stop_str = child.detok.add_tokens(text_tokens)
        if stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
            to_abort.append(out.req_id)
        elif out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        child.new_text += child.detok.delta(child.finish_reason is not None)

    def _positions(self, lp: TopLogprobs, decode: bool = True) -> list[PositionLogprobs]:
        """Each position's logprobs; `decode`: with each token's text (vLLM leaves it None
        when the request is not detokenized)."""
        ids = lp.token_ids
        texts = None
        if decode:
            texts = self.tokenizer.batch_decode(ids.reshape(-1, 1).tolist())
            texts = np.array(texts, dtype=object).reshape(ids.shape)
        out = []
        for p in range(ids.shape[0]):
            entry: PositionLogprobs = {}
            for c in range(ids.shape[1]):
                tok = int(ids[p, c])
                if tok in entry:
                    continue
                entry[tok] = Logprob(float(lp.logprobs[p, c]), lp.rank(p, c),
                                     texts[p, c] if texts is not None else None)
            out.append(entry)
        return out
