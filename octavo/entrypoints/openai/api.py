"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions,
/tokenize, /detokenize."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from octavo.engine.processor import PreparedRequest
from octavo.entrypoints.chat_plan import (
    check_output_spec, model_defaults, plan_output, render_prompt)
from octavo.entrypoints.http import (
    APIError, RequestTimedOut, ServerState, check_model, error_body, state_of, timed,
    unless_disconnected)
from octavo.entrypoints.openai.beam import beam_chat, beam_completions
from octavo.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from octavo.entrypoints.openai.protocol import (
    UNSUPPORTED, ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
    TokenizeRequest)
from octavo.entrypoints.openai.tools import (
    ChatTool, delta_of, message_of, schema_fields, template_message, template_tools,
    tool_request)
from octavo.params import CompletionOutput, RequestOutput, StructuredOutputsParams
from octavo.serving.chat_output import ChatPlan

router = APIRouter()


def _refuse_unsupported(req) -> None:
    bad = req.unsupported_fields()
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported yet ({UNSUPPORTED[bad[0]]})", bad[0])


async def _structured(state: ServerState, body) -> StructuredOutputsParams | None:
    """The request's output constraint, its grammar checked: a problem is a 400 naming it."""
    param = "structured_outputs" if body.structured_outputs is not None else "response_format"
    try:
        spec, field = body.structured_params()
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None
    await check_output_spec(state, spec, field, param)
    return spec


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Collected:
    """The deltas of one request merged back into complete outputs."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.last: dict[int, CompletionOutput] = {}
        self.final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.text[c.index] = self.text.get(c.index, "") + c.text
            self.tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self.logprobs.setdefault(c.index, []).extend(c.logprobs)
            self.last[c.index] = c
        self.final = out


    def usage(self, prompt_tokens: int) -> dict:
        return _usage(prompt_tokens, sum(len(t) for t in self.tokens.values()),
                      self.final.num_cached_tokens if self.final else 0)


async def _collect(stream: AsyncIterator[RequestOutput],
                   collected: _Collected | None = None) -> _Collected:
    collected = collected or _Collected()
    async for out in stream:
        collected.add(out)
    return collected


def _timeout_event(state: ServerState, exc: RequestTimedOut, usage: dict) -> str:
    return _sse(error_body("/v1", 504, str(exc), usage=usage))


# -- models, tokenize --------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = state_of(request)
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "octavo",
         "root": state.engine.config.model.model, "max_model_len": state.engine.max_model_len}
        for name in state.served_model_names]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    check_model(state, body.model)
    tok = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    if body.messages is not None:
        ids = await _render(state, body.messages, body.chat_template, body.tools,
                            body.chat_template_kwargs, body.add_generation_prompt)
    else:
        ids = await state.engine.offload.run("tokenizing the prompt", tok.encode, body.prompt,
                                             body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    check_model(state, body.model)
    vocab = state.engine.processor.vocab_size
    for t in body.tokens:
        if not 0 <= t < vocab:
            raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": await state.engine.offload.run("detokenizing", state.engine.tokenizer.decode,
                                                      body.tokens)}


# -- completions -------------------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    _refuse_unsupported(body)
    if body.logprobs is not None and body.logprobs < 0:
        raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", "logprobs")
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
    params = body.sampling_params(body.max_tokens, body.logprobs,
                                  body.logprobs if body.echo and body.logprobs is not None
                                  else None, model_defaults(state),
                                  await _structured(state, body))
    rid = f"cmpl-{uuid.uuid4().hex}"
    prepared = [await engine.prepare_async(f"{rid}-{i}", p, params, body.priority,
                                           body.cache_salt)
                for i, p in enumerate(prompts)]
    created = int(time.time())
    streams = engine.generate_all(prepared)
    if body.stream:
        return StreamingResponse(
            _stream_completions(state, body, prepared, streams, rid, model, created),
            media_type="text/event-stream")

    results = [_Collected() for _ in streams]

    async def run_all():
        return await asyncio.gather(*(_collect(s, c) for s, c in zip(streams, results)))

    def partial_usage() -> dict:
        n_out = sum(len(t) for c in results for t in c.tokens.values())
        return _usage(sum(len(p.prompt_token_ids) for p in prepared), n_out, 0)

    await unless_disconnected(request, run_all(), partial_usage)
    choices, n_prompt, n_out, cached = [], 0, 0, 0
    for i, (prep, col) in enumerate(zip(prepared, results)):
        n_prompt += len(prep.prompt_token_ids)
        cached += col.final.num_cached_tokens
        for idx in sorted(col.text):
            text, tokens, last = col.text[idx], col.tokens[idx], col.last[idx]
            n_out += len(tokens)
            lps = None
            if body.echo:
                text = (prep.prompt if prep.prompt is not None
                        else engine.tokenizer.decode(prep.prompt_token_ids)) + text
            if body.logprobs is not None:
                positions = col.logprobs.get(idx, [])
                ids = tokens
                if body.echo:
                    positions = (col.final.prompt_logprobs or []) + positions
                    ids = prep.prompt_token_ids + tokens
                lps = completion_logprobs(positions, ids, body.logprobs, engine.tokenizer)
            choices.append({"index": i * body.n + idx, "text": text, "logprobs": lps,
                            "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": _usage(n_prompt, n_out, cached)}


async def _stream_completions(state: ServerState, body: CompletionRequest,
                              prepared: list[PreparedRequest],
                              streams: list[AsyncIterator[RequestOutput]], rid: str, model: str,
                              created: int) -> AsyncIterator[str]:
    engine = state.engine
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n_prompt = sum(len(p.prompt_token_ids) for p in prepared)
    n_out, cached = 0, 0
    try:
        for i, (prep, stream) in enumerate(zip(prepared, streams)):
            offsets: dict[int, int] = {}
            if body.echo:
                text = prep.prompt if prep.prompt is not None else \
                    engine.tokenizer.decode(prep.prompt_token_ids)
                for idx in range(body.n):
                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": [{
                                    "index": i * body.n + idx, "text": text, "logprobs": None,
                                    "finish_reason": None}]})
            async for out in timed(state, stream):
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    n_out += len(c.token_ids)
                    lps = None
                    if body.logprobs is not None:
                        lps = completion_logprobs(c.logprobs or [], c.token_ids, body.logprobs,
                                                  engine.tokenizer, offsets.get(c.index, 0))
                    offsets[c.index] = offsets.get(c.index, 0) + len(c.text)
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": model, "choices": [{
                                 "index": i * body.n + c.index, "text": c.text, "logprobs": lps,
                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
    except RequestTimedOut as exc:
        yield _timeout_event(state, exc, _usage(n_prompt, n_out, cached))
    finally:  # a client gone mid-stream also abandons the prompts not reached yet
        for prep in prepared:
            engine.abort(prep.request_id)
    if include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [], "usage": _usage(n_prompt, n_out, cached)})
    yield "data: [DONE]\n\n"


# -- chat --------------------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    engine = state.engine
    tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    engine.check_size(1, body.n)
    ids = await _render(state, body.messages, body.chat_template, body.tools,
                        body.chat_template_kwargs, body.add_generation_prompt
                        and not body.continue_final_message, body.continue_final_message)
    if body.use_beam_search:
        return await beam_chat(state, body, request, ids, model)
    structured = await _structured(state, body)
    plan = await plan_output(state, tools, schema_fields(body.tools or []), structured, ids,
                             state.parsers.tool_parser.default_id if state.parsers.tool_parser
                             else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(max_tokens, logprobs, defaults=model_defaults(state),
                                  structured=plan.structured,
                                  skip_special_tokens=plan.skip_special_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await engine.prepare_async(rid, ids, params, body.priority, body.cache_salt)
    created = int(time.time())
    stream = engine.generate(prepared)
    if body.stream:
        return StreamingResponse(_stream_chat(state, body, plan, prepared, stream, model,
                                              created),
                                 media_type="text/event-stream")
    col = _Collected()
    await unless_disconnected(request, _collect(stream, col), lambda: col.usage(len(ids)))
    choices, n_out = [], 0
    for idx in sorted(col.text):
        last = col.last[idx]
        n_out += len(col.tokens[idx])
        lps = None
        if body.logprobs:
            lps = {"content": chat_logprobs(col.logprobs.get(idx, []), col.tokens[idx],
                                            body.top_logprobs or 0)}
        parsed = plan.parse(col.text[idx])
        finish = _finish_reason(last.finish_reason, bool(parsed.tool_calls))
        choices.append({"index": idx, "message": message_of(parsed, plan.reads_reasoning),
                        "logprobs": lps, "finish_reason": finish,
                        "stop_reason": last.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": _usage(len(ids), n_out, col.final.num_cached_tokens)}


async def _render(state: ServerState, messages: list[ChatMessage], template: str | None,
                  tools: list[ChatTool] | None, kwargs: dict[str, Any] | None,
                  add_generation_prompt: bool, continue_final_message: bool = False
                  ) -> list[int]:
    """Prompt ids of a conversation; the tools reach the template as `tools`."""
    kwargs = dict(kwargs or {})
    if tools:
        kwargs.setdefault("tools", template_tools(tools))
    return await render_prompt(
        state, [template_message(m.model_dump(exclude_none=True)) for m in messages], template,
        add_generation_prompt, continue_final_message, kwargs)


def _finish_reason(finish: str | None, tool_calls: bool) -> str | None:
    return "tool_calls" if tool_calls and finish == "stop" else finish


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, plan: ChatPlan,
                       prepared: PreparedRequest, stream: AsyncIterator[RequestOutput],
                       model: str, created: int) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created,
            "model": model}

    def chunk(choices: list[dict]) -> str:
        obj = {**base, "choices": choices}
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)])
    readers = [plan.stream() for _ in range(body.n)]
    n_out, cached = 0, 0
    try:
        async for out in timed(state, stream):
            cached = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                n_out += len(c.token_ids)
                lps = None
                if body.logprobs:
                    lps = {"content": chat_logprobs(c.logprobs or [], c.token_ids,
                                                    body.top_logprobs or 0)}
                reader = readers[c.index]
                events = reader.feed(c.text) if c.text else []
                if c.finish_reason is not None:
                    events += reader.finish()
                delta = delta_of(events)
                if not delta and c.finish_reason is None:
                    if plan.plain:
                        delta = {"content": ""}  # a token whose text is not complete yet
                    elif lps is None:
                        continue  # the parsers hold the text back until it is decided
                choices.append({"index": c.index, "delta": delta, "logprobs": lps,
                                "finish_reason": _finish_reason(c.finish_reason,
                                                                reader.has_tool_calls),
                                "stop_reason": c.stop_reason})
            if choices:
                yield chunk(choices)
    except RequestTimedOut as exc:
        yield _timeout_event(state, exc, _usage(len(prepared.prompt_token_ids), n_out,
                                                cached))
    if include_usage:
        yield _sse({**base, "choices": [],
                    "usage": _usage(len(prepared.prompt_token_ids), n_out, cached)})
    yield "data: [DONE]\n\n"
