"""Anthropic tool use and thinking on /v1/messages: the `tools` / `tool_choice` request fields, the
conversation's content blocks as the chat template wants them (`tool_use` → an assistant's
`tool_calls`, `tool_result` → a `tool` message), and the response's content blocks, whole
(`content_blocks`) and streamed (`BlockStream`)."""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from octavo.entrypoints.chat_plan import FunctionName
from octavo.entrypoints.http import APIError
from octavo.serving.chat_output import ChatEvent, ParsedChat, ReasoningText, ToolRequest
from octavo.serving.tool_choice import FunctionSpec
from octavo.serving.tool_parsers import ContentDelta, ToolCallDelta, ToolParser, tool_call_id


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced where a grammar applies
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool of type "tool"
    disable_parallel_tool_use: bool | None = None


def tool_request(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolRequest | None:
    """Protocol-neutral tools and choice (None: no tools). A problem is a 400 naming the field."""
    if choice is not None and (choice.type == "tool") != (choice.name is not None):
        raise APIError(400, "tool_choice.name is required with type 'tool' (and only then)",
                       "tool_choice.name")
    if not tools:
        if choice is None or choice.type == "none":
            return None
        raise APIError(400, f"tool_choice of type {choice.type!r} needs tools", "tool_choice")
    functions = tuple(FunctionSpec(t.name, t.input_schema) for t in tools)
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools.{i}.name: tool names must be unique; {name!r} repeats",
                           "tools")
    kind = "auto" if choice is None else choice.type
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    return ToolRequest(mode, functions, choice.name if choice else None, parallel)


def schema_fields(tools: Sequence[Tool]) -> list[str]:
    return [f"tools.{i}.input_schema" for i in range(len(tools))]


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools in the OpenAI shape that chat templates read."""
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            function["description"] = t.description
        out.append({"type": "function", "function": function})
    return out


def new_id_for(parser: type[ToolParser] | None):
    """Call ids: Anthropic's `toolu_...`, unless the model's tool-call format has its own (its
    chat template checks them)."""
    if parser is not None and parser.default_id is not ToolParser.default_id:
        return parser.default_id
    return lambda: tool_call_id("toolu_")


def template_messages(i: int, role: str, content: str | list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """Message `i` of the request as chat-template messages: text joined; an assistant's
    `tool_use` blocks become its `tool_calls`; a user's `tool_result` blocks become `tool`
    messages (in place, around the user's text); `thinking` blocks are dropped."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        where = f"messages.{i}.content.{j}"
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise APIError(400, f"{where}: a tool_use block needs a string 'id' and 'name' "
                                    "and an object 'input'", f"messages.{i}.content")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{where}: a tool_result block needs a string 'tool_use_id'",
                               f"messages.{i}.content")
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _result_text(block.get("content", ""), where)})
        else:
            raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported in "
                                f"{role} messages", f"messages.{i}.content")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out


def _result_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise APIError(400, f"{where}.content: a tool result must be a string or text blocks",
                   where)


def content_blocks(parsed: ParsedChat) -> list[dict[str, Any]]:
    """The response's content: thinking, then text, then tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": json.loads(call.arguments)})
    return blocks


class BlockStream:
    """Streamed events → Anthropic's content block events: a block opens when the kind of
    output changes (thinking, text, each tool call) and closes before the next one opens."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None  # "thinking" | "text" | "tool_use"

    def events(self, events: list[ChatEvent]) -> Iterator[dict[str, Any]]:
        for e in events:
            if isinstance(e, ReasoningText):
                yield from self._ensure("thinking", {"type": "thinking", "thinking": "",
                                                     "signature": ""})
                yield self._delta({"type": "thinking_delta", "thinking": e.text})
            elif isinstance(e, ContentDelta):
                yield from self._ensure("text", {"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": e.text})
            elif isinstance(e, ToolCallDelta):
                if e.id is not None:  # a new call: always a new block
                    yield from self._ensure("tool_use", {"type": "tool_use", "id": e.id,
                                                         "name": e.name, "input": {}})
                if e.arguments:
                    yield self._delta({"type": "input_json_delta", "partial_json": e.arguments})

    def open_text(self) -> Iterator[dict[str, Any]]:
        """Open a text block now (a plain output's one block starts before any text)."""
        yield from self._ensure("text", {"type": "text", "text": ""})

    def close(self) -> Iterator[dict[str, Any]]:
        if self._open is not None:
            self._open = None
            yield {"type": "content_block_stop", "index": self._index}

    def finish(self) -> Iterator[dict[str, Any]]:
        """Close the last block; an output with no block at all gets an empty text block."""
        if self._index < 0:
            yield from self._ensure("text", {"type": "text", "text": ""})
        yield from self.close()

    def _ensure(self, kind: str, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self._open == kind and kind != "tool_use":
            return
        yield from self.close()
        self._index += 1
        self._open = kind
        yield {"type": "content_block_start", "index": self._index, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}
