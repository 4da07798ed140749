"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions (with vLLM's extensions: echo,
return_token_ids, return_tokens_as_token_ids, add_special_tokens, request_id, usage on every
streamed chunk), /tokenize, /detokenize; /v1/completions is in completions.py."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from octavo.engine.processor import PreparedRequest
from octavo.entrypoints.chat_plan import model_defaults, plan_output, render_prompt
from octavo.entrypoints.http import (
    STREAM_ERRORS, APIError, ServerState, adapter_of, check_model, detokenize_ids, state_of,
    timed, unless_disconnected)
from octavo.entrypoints.openai import completions
from octavo.entrypoints.openai.beam import beam_chat
from octavo.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from octavo.entrypoints.openai.protocol import (
    ChatCompletionRequest, DetokenizeRequest, TokenizeRequest)
from octavo.entrypoints.openai.shared import (
    Collected, collect, engine_id, refuse_unsupported, response_id, sse, structured,
    stream_error_event, token_ids_fields, usage, usage_options)
from octavo.entrypoints.openai.tools import (
    delta_of, message_of, schema_fields, template_message, template_tools, tool_request)
from octavo.params import PositionLogprobs, RequestOutput
from octavo.serving.chat_output import ChatPlan

router = APIRouter()
router.include_router(completions.router)


# -- models, tokenize --------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = state_of(request)
    created = int(time.time())
    base = state.served_model_names[0]
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "octavo",
              "root": state.engine.config.model.model, "parent": None,
              "max_model_len": state.engine.max_model_len}
             for name in state.served_model_names]
    cards += [{"id": name, "object": "model", "created": created, "owned_by": "octavo",
               "root": lora.lora_path, "parent": base,
               "max_model_len": state.engine.max_model_len}
              for name, lora in state.engine.processor.adapters.named.items()]
    return {"object": "list", "data": cards}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    check_model(state, body.model)
    tok = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    if body.messages is not None:
        ids = await _render(state, body)
    else:
        ids = await state.engine.offload.run("tokenizing the prompt", tok.encode, body.prompt,
                                             body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    check_model(state, body.model)
    return {"prompt": await detokenize_ids(state, body.tokens, "tokens")}


# -- chat --------------------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    engine = state.engine
    tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    engine.check_size(1, body.n)
    ids = await _render(state, body, body.continue_final_message, body.add_special_tokens)
    if body.use_beam_search:
        return await beam_chat(state, body, request, ids, model)
    spec = await structured(state, body)
    plan = await plan_output(state, tools, schema_fields(body.tools or []), spec, ids,
                             state.parsers.tool_parser.default_id if state.parsers.tool_parser
                             else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(max_tokens, logprobs, defaults=model_defaults(state),
                                  structured=plan.structured,
                                  skip_special_tokens=plan.skip_special_tokens)
    rid = response_id("chatcmpl", body)
    prepared = await engine.prepare_async(engine_id(rid, body), ids, params, body.priority,
                                          body.cache_salt,
                                          lora_request=adapter_of(state, body.model))
    created = int(time.time())
    stream = engine.generate(prepared)
    role, echo = _role_and_echo(body)
    if body.stream:
        return StreamingResponse(_stream_chat(state, body, plan, prepared, stream, rid, model,
                                              created, role, echo),
                                 media_type="text/event-stream")
    col = Collected()
    await unless_disconnected(request, collect(stream, col), lambda: col.usage(len(ids)))
    prompt_ids = prepared.prompt_token_ids
    choices, n_out = [], 0
    for idx in sorted(col.text):
        last = col.last[idx]
        n_out += len(col.tokens[idx])
        parsed = plan.parse(col.text[idx])
        message = message_of(parsed, plan.reads_reasoning)
        message["role"] = role
        if echo:
            message["content"] = echo + (message.get("content") or "")
        choice = {"index": idx, "message": message,
                  "logprobs": _logprobs(body, col.logprobs.get(idx, []), col.tokens[idx]),
                  "finish_reason": _finish_reason(last.finish_reason, bool(parsed.tool_calls)),
                  "stop_reason": last.stop_reason}
        choices.append(token_ids_fields(body, choice, col.tokens[idx]))
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(len(prompt_ids), n_out, col.final.num_cached_tokens)}
    if body.return_token_ids:
        response["prompt_token_ids"] = list(prompt_ids)
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(col.final.prompt_logprobs)
    return response


async def _render(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                  continue_final_message: bool = False,
                  add_special_tokens: bool = False) -> list[int]:
    """Prompt ids of a conversation; the tools reach the template as `tools`."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        kwargs.setdefault("tools", template_tools(body.tools))
    return await render_prompt(
        state, [template_message(m.model_dump(exclude_none=True)) for m in body.messages],
        body.chat_template, body.add_generation_prompt and not continue_final_message,
        continue_final_message, kwargs, add_special_tokens)


def _role_and_echo(body: ChatCompletionRequest) -> tuple[str, str]:
    """The reply's role (vLLM's: the assistant's after a generation prompt, else the last
    message's) and, with echo, the text it starts with: the last message's content where that
    message has the reply's role."""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt and not body.continue_final_message \
        else last.role
    if not body.echo or last.role != role:
        return role, ""
    content = last.content
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
    return role, content or ""


def _logprobs(body: ChatCompletionRequest, positions: list[PositionLogprobs],
              tokens: list[int]) -> dict | None:
    if not body.logprobs:
        return None
    return {"content": chat_logprobs(positions, tokens, body.top_logprobs or 0,
                                     bool(body.return_tokens_as_token_ids),
                                     body.logprob_token_ids is not None)}


def _finish_reason(finish: str | None, tool_calls: bool) -> str | None:
    return "tool_calls" if tool_calls and finish == "stop" else finish


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, plan: ChatPlan,
                       prepared: PreparedRequest, stream: AsyncIterator[RequestOutput],
                       rid: str, model: str, created: int, role: str, echo: str
                       ) -> AsyncIterator[str]:
    include_usage, continuous = usage_options(body)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    n_prompt = len(prepared.prompt_token_ids)
    n_out, cached = 0, 0

    def chunk(choices: list[dict], **extra: Any) -> str:
        obj = {**base, "choices": choices, **extra}
        if include_usage:
            obj["usage"] = usage(n_prompt, n_out, cached) if continuous else None
        return sse(obj)

    first = chunk([{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(body.n)],
                  **({"prompt_token_ids": list(prepared.prompt_token_ids)}
                     if body.return_token_ids else {}))
    yield first
    if echo:
        yield chunk([{"index": i, "delta": {"content": echo}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
    readers = [plan.stream() for _ in range(body.n)]
    try:
        async for out in timed(state, stream):
            cached = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                n_out += len(c.token_ids)
                lps = _logprobs(body, c.logprobs or [], c.token_ids)
                reader = readers[c.index]
                events = reader.feed(c.text) if c.text else []
                if c.finish_reason is not None:
                    events += reader.finish()
                delta = delta_of(events)
                if not delta and c.finish_reason is None:
                    if plan.plain:
                        delta = {"content": ""}  # a token whose text is not complete yet
                    elif lps is None and not body.return_token_ids:
                        continue  # the parsers hold the text back until it is decided
                choices.append(token_ids_fields(body, {
                    "index": c.index, "delta": delta, "logprobs": lps,
                    "finish_reason": _finish_reason(c.finish_reason, reader.has_tool_calls),
                    "stop_reason": c.stop_reason}, c.token_ids))
            if choices:
                yield chunk(choices)
    except STREAM_ERRORS as exc:
        yield stream_error_event(exc, usage(n_prompt, n_out, cached))
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(n_prompt, n_out, cached)})
    yield "data: [DONE]\n\n"
