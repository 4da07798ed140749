"""Anthropic Messages API: POST /v1/messages (stream and not) and /v1/messages/count_tokens."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from octavo.engine.processor import PreparedRequest
from octavo.entrypoints.anthropic.tools import (
    BlockStream, Tool, ToolChoice, content_blocks, new_id_for, schema_fields, template_messages,
    template_tools, tool_request)
from octavo.entrypoints.chat_plan import model_defaults, plan_output, render_prompt
from octavo.entrypoints.http import (
    STREAM_ERRORS, APIError, ServerState, adapter_of, check_model, error_body, state_of,
    stream_error, timed,
    unless_disconnected)
from octavo.params import RequestOutput, SamplingParams
from octavo.serving.chat_output import ChatPlan

router = APIRouter()

_UNSUPPORTED = {"thinking": "extended thinking settings (a server started with "
                            "--reasoning-parser returns thinking blocks)",
                "mcp_servers": "MCP servers", "container": "containers",
                "output_config": "output configuration (structured output)"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: Any = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # accepted bookkeeping fields of newer SDKs, with no effect on generation here
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: Any = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: Any = None
    mcp_servers: Any = None
    container: Any = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None


def _conversation(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    for name, what in _UNSUPPORTED.items():
        if getattr(body, name, None) is not None:
            raise APIError(400, f"'{name}' is not supported yet ({what})", name)
    conv: list[dict[str, Any]] = []
    if body.system:
        text = body.system if isinstance(body.system, str) else \
            "".join(b.text for b in body.system)
        conv.append({"role": "system", "content": text})
    for i, m in enumerate(body.messages):
        conv.extend(template_messages(i, m.role, m.content))
    return conv


async def _prompt_ids(state: ServerState,
                      body: MessagesRequest | CountTokensRequest) -> list[int]:
    conv = _conversation(body)
    # A final assistant turn is a prefill the reply continues, as Anthropic's API defines.
    prefill = conv[-1]["role"] == "assistant"
    kwargs = {"tools": template_tools(body.tools)} if body.tools else None
    return await render_prompt(state, conv, None, add_generation_prompt=not prefill,
                               continue_final_message=prefill, template_kwargs=kwargs)


def _stop_reason(finish: str | None, stop: int | str | None,
                 tool_calls: bool = False) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if tool_calls else "end_turn"), None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    state = state_of(request)
    check_model(state, body.model)
    return {"input_tokens": len(await _prompt_ids(state, body))}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    tools = tool_request(body.tools, body.tool_choice)
    ids = await _prompt_ids(state, body)
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {body.max_tokens}", "max_tokens")
    plan = await plan_output(state, tools, schema_fields(body.tools or []), None, ids,
                             new_id_for(state.parsers.tool_parser))
    defaults = model_defaults(state)
    params = SamplingParams(
        max_tokens=body.max_tokens, stop=body.stop_sequences,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        skip_special_tokens=plan.skip_special_tokens is not False,
        structured_outputs=plan.structured)
    if body.temperature is not None and body.temperature > 1.0:
        raise APIError(400, f"temperature must be in [0, 1], got {body.temperature}",
                       "temperature")
    msg_id = f"msg_{uuid.uuid4().hex}"
    prepared = await state.engine.prepare_async(msg_id, ids, params,
                                                lora_request=adapter_of(state, body.model))
    stream = state.engine.generate(prepared)
    if body.stream:
        return StreamingResponse(_stream(state, plan, prepared, stream, model),
                                 media_type="text/event-stream")
    got = {"output_tokens": 0}

    async def run() -> tuple[str, int, Any]:
        text, last = "", None
        async for out in stream:
            last = out.outputs[0]
            text += last.text
            got["output_tokens"] += len(last.token_ids)
        return text, got["output_tokens"], last

    text, n_out, last = await unless_disconnected(
        request, run(), lambda: {"input_tokens": len(ids), **got})
    parsed = plan.parse(text)
    reason, sequence = _stop_reason(last.finish_reason, last.stop_reason, bool(parsed.tool_calls))
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(parsed), "stop_reason": reason,
            "stop_sequence": sequence, "usage": {"input_tokens": len(ids), "output_tokens": n_out}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(state: ServerState, plan: ChatPlan, prepared: PreparedRequest,
                  stream: AsyncIterator[RequestOutput], model: str) -> AsyncIterator[str]:
    n_in = len(prepared.prompt_token_ids)
    yield _event("message_start", {"type": "message_start", "message": {
        "id": prepared.request_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_in, "output_tokens": 0}}})
    blocks, reader = BlockStream(), plan.stream()
    if plan.plain:  # one text block, opened at once as Anthropic does
        for e in blocks.open_text():
            yield _event(e["type"], e)
    yield _event("ping", {"type": "ping"})
    n_out, last = 0, None
    try:
        async for out in timed(state, stream):
            c = out.outputs[0]
            n_out += len(c.token_ids)
            last = c
            events = reader.feed(c.text) if c.text else []
            if c.finish_reason is not None:
                events += reader.finish()
            for e in blocks.events(events):
                yield _event(e["type"], e)
    except STREAM_ERRORS as exc:  # Anthropic's error event, and the stream ends
        yield _event("error", error_body("/v1/messages", *stream_error(exc)))
        return
    for e in blocks.finish():
        yield _event(e["type"], e)
    reason, sequence = _stop_reason(last.finish_reason if last else None,
                                    last.stop_reason if last else None, reader.has_tool_calls)
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": n_out}})
    yield _event("message_stop", {"type": "message_stop"})
