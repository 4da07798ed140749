"""The OpenAI Responses API: POST /v1/responses (streamed as the Responses API's events, or
whole), GET and DELETE /v1/responses/{id} for stored responses.

A request runs on the chat path: its input (after the stored conversation of
`previous_response_id`, with `instructions` as a system message first) is rendered by the chat
template, the tool step plans the output, and the engine admits, times and aborts it as it does a
chat completion. Both forms of the answer come from one event generator (`_Run.events`).
"""
from __future__ import annotations

import json
import logging
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
    STREAM_ERRORS, APIError, ServerState, adapter_of, check_model, state_of, stream_error,
    timed, unless_disconnected)
from octavo.entrypoints.openai.responses_output import (
    OutputItems, reasoning_token_count, usage)
from octavo.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages
from octavo.entrypoints.openai.tools import template_message, template_tools, tool_request
from octavo.params import RequestOutput, SamplingParams
from octavo.serving.chat_output import ChatPlan

logger = logging.getLogger(__name__)
router = APIRouter()

_FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    body.refuse_unsupported()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.response_store.get(body.previous_response_id)
        if previous is None:  # as OpenAI answers it: the request is bad, not the route
            raise APIError(400, f"Previous response with id '{body.previous_response_id:.80}' "
                                f"not found.", "previous_response_id")
        history = previous.conversation
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}]
                if body.instructions is not None else []) + conversation
    chat_tools = body.chat_tools()
    tools = tool_request(chat_tools, body.chat_tool_choice(), body.parallel_tool_calls)
    engine = state.engine
    engine.check_size(1, 1)
    ids = await render_prompt(state, [template_message(m) for m in messages], None, True,
                              template_kwargs={"tools": template_tools(chat_tools)}
                              if chat_tools else None)
    spec, field = body.structured_params()
    await check_output_spec(state, spec, field, "text.format")
    plan = await plan_output(state, tools,
                             [f"tools[{i}].parameters" for i in range(len(chat_tools or []))],
                             spec, ids, state.parsers.tool_parser.default_id
                             if state.parsers.tool_parser else None)
    params = body.sampling_params(model_defaults(state), plan.structured,
                                  plan.skip_special_tokens is not False)
    rid = f"resp_{uuid.uuid4().hex}"
    prepared = await engine.prepare_async(rid, ids, params, body.priority, body.cache_salt,
                                          lora_request=adapter_of(state, body.model))
    run = _Run(state, body, model, plan, params, prepared, conversation)
    stream = engine.generate(prepared)
    if body.stream:
        return StreamingResponse(run.sse(timed(state, stream)), media_type="text/event-stream")
    final = await unless_disconnected(request, run.last_event(stream), run.partial_usage)
    return final["response"]


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, stream: bool = False):
    if stream:
        raise APIError(400, "stream=true (replaying a stored response's events) is not "
                            "supported yet", "stream")
    entry = state_of(request).response_store.get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id '{response_id:.80}' not found.", "response_id")
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    if not state_of(request).response_store.delete(response_id):
        raise APIError(404, f"Response with id '{response_id:.80}' not found.", "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


class _Run:
    """One response being generated: its event stream, usage and final object."""

    def __init__(self, state: ServerState, body: ResponsesRequest, model: str, plan: ChatPlan,
                 params: SamplingParams, prepared: PreparedRequest,
                 conversation: list[dict[str, Any]]) -> None:
        self.state, self.body, self.model, self.plan = state, body, model, plan
        self.params, self.prepared, self.conversation = params, prepared, conversation
        self.created = int(time.time())
        self.output_ids: list[int] = []
        self.cached = 0
        self.items = OutputItems()

    @property
    def id(self) -> str:
        return self.prepared.request_id

    def partial_usage(self) -> dict[str, Any]:
        return usage(len(self.prepared.prompt_token_ids), len(self.output_ids), self.cached,
                     0)

    async def last_event(self, stream: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        event: dict[str, Any] = {}
        async for event in self.events(stream):
            pass
        return event

    async def sse(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        seq = 0
        try:
            async for event in self.events(stream):
                yield (f"event: {event['type']}\ndata: "
                       f"{json.dumps({**event, 'sequence_number': seq}, ensure_ascii=False)}"
                       f"\n\n")
                seq += 1
        finally:  # the client gone mid-stream: the request goes with it
            self.state.engine.abort(self.id)

    async def events(self, stream: AsyncIterator[RequestOutput]
                     ) -> AsyncIterator[dict[str, Any]]:
        """The Responses API events of this run, ending with its final response (stored when
        the request asks for it)."""
        started = self.response("in_progress")
        yield {"type": "response.created", "response": started}
        yield {"type": "response.in_progress", "response": started}
        reader = self.plan.stream()
        last = None
        try:
            async for out in stream:
                last = out.outputs[0]
                self.cached = out.num_cached_tokens
                self.output_ids.extend(last.token_ids)
                events = reader.feed(last.text) if last.text else []
                if last.finish_reason is not None:
                    events += reader.finish()
                for event in self.items.feed(events):
                    yield event
        except STREAM_ERRORS as exc:
            if not self.body.stream:  # a plain reply: unless_disconnected times it, and a
                raise  # dead engine is its error response
            for event in self.items.finish("incomplete"):
                yield event
            yield {"type": "response.failed", "response": self._stored(self.response(
                "failed", error={"code": "server_error", "message": stream_error(exc)[1]},
                usage=self.partial_usage()))}
            return
        finish = last.finish_reason if last is not None else None
        status = {"stop": "completed", "length": "incomplete"}.get(finish, "failed")
        for event in self.items.finish("completed" if status == "completed" else "incomplete"):
            yield event
        final = self.response(
            status, usage=await self._usage(),
            incomplete={"reason": "max_output_tokens"} if status == "incomplete" else None,
            error={"code": "server_error",
                   "message": str((last.stop_reason if last else None) or "aborted")}
            if status == "failed" else None)
        yield {"type": _FINAL_EVENTS[status], "response": self._stored(final)}

    def _stored(self, final: dict[str, Any]) -> dict[str, Any]:
        if not self.body.store:
            return final
        turn = self.conversation + [self.items.assistant_message()]
        if self.state.response_store.put(self.id, final, turn):
            return final
        logger.warning("response %s is larger than the whole response store; not stored",
                       self.id)
        return {**final, "store": False}

    async def _usage(self) -> dict[str, Any]:
        reasoning = 0
        if self.plan.reads_reasoning:
            rule = self.state.parsers.reasoning_end
            if rule is not None:
                reasoning = reasoning_token_count(rule, self.output_ids)
            else:  # the tags are not single tokens: count the reasoning text's tokens
                text = "".join(part["text"] for item in self.items.items
                               if item["type"] == "reasoning" for part in item["content"])
                if text:
                    reasoning = len(await self.state.engine.offload.run(
                        "counting reasoning tokens", self.state.engine.tokenizer.encode,
                        text, False))
        return usage(len(self.prepared.prompt_token_ids), len(self.output_ids), self.cached,
                     reasoning)

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None,
                 incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": self.model,
            "output": list(self.items.items) if done else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": (body.reasoning.model_dump(exclude_none=True) if body.reasoning
                          else {"effort": None, "summary": None}),
            "service_tier": "default", "store": body.store,
            "temperature": self.params.temperature, "text": body.text_echo(),
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "top_p": self.params.top_p, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {}}
