"""OpenAI tool calling and reasoning on /v1/chat/completions: the `tools` / `tool_choice` request
fields, the conversation as the chat template wants it (assistant `tool_calls`, `tool` results),
and the message and stream-delta shapes of tool calls and `reasoning_content`."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from octavo.entrypoints.chat_plan import FunctionName
from octavo.entrypoints.http import APIError
from octavo.serving.chat_output import ChatEvent, ParsedChat, ReasoningText, ToolRequest
from octavo.serving.tool_choice import FunctionSpec
from octavo.serving.tool_parsers import ContentDelta, ToolCallDelta


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any arguments object
    strict: bool | None = None  # the schema is always enforced where a grammar applies


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolChoiceFunction


# A string or a named function; checked in `tool_request` for a message that names the choices.
ToolChoice = str | dict[str, Any]
_CHOICES = ("none", "auto", "required")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_request(tools: list[ChatTool] | None, choice: ToolChoice | None,
                 parallel: bool | None) -> ToolRequest | None:
    """The request's tools as protocol-neutral specs (None: no tools and no choice needing
    them). A problem is a 400 naming the field."""
    if isinstance(choice, dict):
        try:
            choice = NamedToolChoice.model_validate(choice)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise APIError(400, f"tool_choice.{where}: {err['msg']} (a named choice is "
                                '{"type": "function", "function": {"name": ...}})',
                           "tool_choice") from None
    elif choice is not None and choice not in _CHOICES:
        raise APIError(400, f"tool_choice must be one of {', '.join(map(repr, _CHOICES))} or "
                            f"a named function, got {choice!r:.80}", "tool_choice")
    if not tools:
        if choice is None or choice == "none":
            return None
        shown = choice if isinstance(choice, str) else "a named function"
        raise APIError(400, f"tool_choice {shown!r} needs tools", "tool_choice")
    functions = tuple(FunctionSpec(t.function.name, t.function.parameters) for t in tools)
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools[{i}].function.name: function names must be unique; "
                                f"{name!r} repeats", "tools")
    parallel = True if parallel is None else parallel
    if isinstance(choice, NamedToolChoice):
        return ToolRequest("named", functions, choice.function.name, parallel)
    return ToolRequest(choice or "auto", functions, None, parallel)


def schema_fields(tools: list[ChatTool]) -> list[str]:
    return [f"tools[{i}].function.parameters" for i in range(len(tools))]


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates read them: OpenAI's own shape."""
    return [t.model_dump(exclude_none=True) for t in tools]


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template wants it: an assistant's tool call arguments as an object
    (templates write `arguments | tojson`); text that is not a JSON object stays a string."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


def message_of(parsed: ParsedChat, reads_reasoning: bool) -> dict[str, Any]:
    """The `message` of a non-streamed choice."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": parsed.content if parsed.content or not parsed.tool_calls
                           else None}
    if reads_reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    return msg


def delta_of(events: list[ChatEvent]) -> dict[str, Any]:
    """One streamed `delta` holding a step's events: reasoning and content text joined, tool
    calls as OpenAI streams them (index, id, type and name first, then argument fragments)."""
    delta: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ReasoningText):
            delta["reasoning_content"] = delta.get("reasoning_content", "") + e.text
        elif isinstance(e, ContentDelta):
            delta["content"] = delta.get("content", "") + e.text
        elif isinstance(e, ToolCallDelta):
            if e.id is not None:
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": e.arguments}})
            elif calls and calls[-1]["index"] == e.index:
                calls[-1]["function"]["arguments"] += e.arguments
            else:
                calls.append({"index": e.index, "function": {"arguments": e.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta
