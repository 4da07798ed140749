"""POST /v1/completions, with vLLM's extensions: echo (the prompt before each choice, with its
logprobs), max_tokens 0 with echo (the prompt alone: one token is generated for its logprobs and
dropped), return_token_ids, return_tokens_as_token_ids, add_special_tokens, request_id, usage on
every streamed chunk (stream_options.continuous_usage_stats)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from octavo.engine.processor import PreparedRequest
from octavo.entrypoints.chat_plan import model_defaults
from octavo.entrypoints.http import (
    STREAM_ERRORS, APIError, ServerState, adapter_of, check_model, state_of, timed,
    unless_disconnected)
from octavo.entrypoints.openai.beam import beam_completions
from octavo.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_json
from octavo.entrypoints.openai.protocol import CompletionRequest
from octavo.entrypoints.openai.shared import (
    Collected, collect, engine_id, refuse_unsupported, response_id, sse, structured,
    stream_error_event, token_ids_fields, usage, usage_options)
from octavo.params import CompletionOutput, PositionLogprobs, RequestOutput

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    refuse_unsupported(body)
    if body.logprobs is not None and body.logprobs < -1:
        raise APIError(400, f"logprobs must be >= 0 or -1 (the whole vocabulary), got "
                       f"{body.logprobs}", "logprobs")
    if body.echo_only and body.logprob_token_ids is not None:
        raise APIError(400, "logprob_token_ids cannot be used with echo and max_tokens 0 (no "
                       "output token is returned)", "logprob_token_ids")
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    engine = state.engine
    engine.check_size(len(prompts), body.n, body.best_of)
    if body.use_beam_search:
        return await beam_completions(state, body, request, prompts, model)
    if body.stream and body.best_of is not None and body.best_of > body.n:
        raise APIError(400, "best_of > n cannot be streamed (the best are known only at the "
                       "end)", "best_of")
    echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(1 if body.echo_only else body.max_tokens, body.logprobs,
                                  echo_lp, model_defaults(state),
                                  await structured(state, body))
    rid = response_id("cmpl", body)
    base = engine_id(rid, body)
    lora = adapter_of(state, body.model)
    prepared = [await engine.prepare_async(f"{base}-{i}", p, params, body.priority,
                                           body.cache_salt, body.add_special_tokens, lora)
                for i, p in enumerate(prompts)]
    created = int(time.time())
    streams = engine.generate_all(prepared)
    if body.stream:
        return StreamingResponse(
            _stream(state, body, prepared, streams, rid, model, created),
            media_type="text/event-stream")

    results = [Collected() for _ in streams]

    async def run_all():
        return await asyncio.gather(*(collect(s, c) for s, c in zip(streams, results)))

    def partial_usage() -> dict:
        n_out = sum(len(t) for c in results for t in c.tokens.values())
        return usage(sum(len(p.prompt_token_ids) for p in prepared), n_out)

    await unless_disconnected(request, run_all(), partial_usage)
    choices, n_prompt, n_out, cached = [], 0, 0, 0
    for i, (prep, col) in enumerate(zip(prepared, results)):
        n_prompt += len(prep.prompt_token_ids)
        cached += col.final.num_cached_tokens
        for idx in sorted(col.text):
            tokens, last = col.tokens[idx], col.last[idx]
            n_out += len(tokens)
            text, ids, positions = _shown(body, state, prep, col.final.prompt_logprobs,
                                          col.text[idx], tokens, col.logprobs.get(idx, []),
                                          echoed=True)
            choice = {"index": i * body.n + idx, "text": text,
                      "logprobs": _logprobs(body, state, positions, ids),
                      "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(col.final.prompt_logprobs)
            choices.append(token_ids_fields(body, choice, tokens, prep.prompt_token_ids))
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(n_prompt, n_out, cached)}


def _prompt_text(body: CompletionRequest, state: ServerState, prep: PreparedRequest) -> str:
    """The echoed prompt: its text (decoded where it came as ids); as in vLLM, none where the
    client asked for token ids instead."""
    if body.return_token_ids:
        return ""
    if prep.prompt is not None:
        return prep.prompt
    return state.engine.tokenizer.decode(prep.prompt_token_ids)


def _shown(body: CompletionRequest, state: ServerState, prep: PreparedRequest,
           prompt_lps: list[PositionLogprobs | None] | None, text: str, tokens: list[int],
           positions: list, echoed: bool) -> tuple[str, list[int], list]:
    """What a choice shows of (text, tokens, logprob positions): nothing generated when only
    the prompt was asked for (echo, max_tokens 0); the prompt before it where `echoed`."""
    if body.echo_only:
        text, tokens, positions = "", [], []
    if body.echo and echoed:
        text = _prompt_text(body, state, prep) + text
        tokens = prep.prompt_token_ids + tokens
        positions = list(prompt_lps or []) + positions
    return text, tokens, positions


def _logprobs(body: CompletionRequest, state: ServerState, positions: list, ids: list[int],
              offset: int = 0) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(positions, ids, body.logprobs, state.engine.tokenizer, offset,
                               bool(body.return_tokens_as_token_ids),
                               body.logprob_token_ids is not None)


def _merged(outs: list[CompletionOutput]) -> CompletionOutput:
    """One delta of several (a choice held back until its prompt's logprobs were all in)."""
    last = outs[-1]
    return CompletionOutput(last.index, "".join(o.text for o in outs),
                            [t for o in outs for t in o.token_ids], last.cumulative_logprob,
                            [p for o in outs for p in (o.logprobs or [])],
                            last.finish_reason, last.stop_reason)


async def _stream(state: ServerState, body: CompletionRequest, prepared: list[PreparedRequest],
                  streams: list[AsyncIterator[RequestOutput]], rid: str, model: str,
                  created: int) -> AsyncIterator[str]:
    engine = state.engine
    include_usage, continuous = usage_options(body)
    n_prompt = sum(len(p.prompt_token_ids) for p in prepared)
    n_out, cached = 0, 0

    def chunk(i: int, prep: PreparedRequest, c: CompletionOutput, first: bool,
              prompt_lps: list | None, offset: int, done_tokens: int) -> tuple[str, int]:
        text, ids, positions = _shown(body, state, prep, prompt_lps, c.text, c.token_ids,
                                      c.logprobs or [], echoed=first)
        choice = {"index": i * body.n + c.index, "text": text,
                  "logprobs": _logprobs(body, state, positions, ids, offset),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        token_ids_fields(body, choice, c.token_ids, prep.prompt_token_ids if first else None)
        obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [choice]}
        if include_usage:
            obj["usage"] = usage(len(prep.prompt_token_ids), done_tokens, cached) \
                if continuous else None
        return sse(obj), len(text)

    try:
        for i, (prep, stream) in enumerate(zip(prepared, streams)):
            offsets: dict[int, int] = {}  # text sent per choice
            counts: dict[int, int] = {}  # tokens generated per choice
            held: dict[int, list[CompletionOutput]] = {}
            wait_for_prompt_lps = body.echo and body.logprobs is not None
            out = None
            async for out in timed(state, stream):
                cached = max(cached, out.num_cached_tokens)
                prompt_ready = not wait_for_prompt_lps or \
                    len(out.prompt_logprobs or []) >= len(prep.prompt_token_ids)
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    n_out += len(c.token_ids)
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
                    first = c.index not in offsets
                    if first and not prompt_ready:  # its echo needs the prompt's logprobs
                        held.setdefault(c.index, []).append(c)
                        continue
                    if first and c.index in held:
                        c = _merged(held.pop(c.index) + [c])
                    event, sent = chunk(i, prep, c, first, out.prompt_logprobs,
                                        offsets.get(c.index, 0), counts[c.index])
                    offsets[c.index] = offsets.get(c.index, 0) + sent
                    yield event
            for index, outs in held.items():  # the prompt's logprobs never all came
                event, _ = chunk(i, prep, _merged(outs), True,
                                 out.prompt_logprobs if out else None, 0, counts[index])
                yield event
    except STREAM_ERRORS as exc:
        yield stream_error_event(exc, usage(n_prompt, n_out, cached))
    finally:  # a client gone mid-stream also abandons the prompts not reached yet
        for prep in prepared:
            engine.abort(prep.request_id)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(n_prompt, n_out, cached)})
    yield "data: [DONE]\n\n"
