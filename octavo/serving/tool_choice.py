"""Grammars and parsers for tool_choice `required` and a named function.

With these choices the output is constrained (structured output, a JSON schema built from the
functions' parameter schemas), so the model does not write its own tool-call format:
- `required` (OpenAI) / `any` (Anthropic): a JSON array of one or more
  `{"name": ..., "arguments": {...}}` objects, each name one of the tools' and its arguments valid
  against that tool's schema; read by `JsonArrayToolParser`.
- a named function (OpenAI `{"type": "function", ...}` / Anthropic `{"type": "tool", ...}`): the
  arguments object alone, since the name is known; read by `NamedToolParser`.
Both parsers give the same events as the format parsers, so the API layers stream them the same
way.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from octavo.serving.tool_parsers.base import ToolParser
from octavo.serving.tool_parsers.json_call import JsonArguments, JsonCall


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A tool as the grammar needs it: OpenAI's function.{name, parameters}, Anthropic's
    {name, input_schema}."""
    name: str
    parameters: Mapping[str, Any] | None = None  # JSON schema of the arguments; None: any object


def _arguments_schema(function: FunctionSpec) -> dict[str, Any]:
    return dict(function.parameters) if function.parameters else {"type": "object"}


def named_tool_schema(function: FunctionSpec) -> dict[str, Any]:
    """The schema of a named function's output: its arguments object."""
    return _arguments_schema(function)


def required_tools_schema(functions: Sequence[FunctionSpec], parallel: bool = True
                          ) -> dict[str, Any]:
    """The schema of a `required` output: an array of calls to these functions (at most one call
    when `parallel` is false, as with OpenAI's parallel_tool_calls=false)."""
    if not functions:
        raise ValueError("tools: tool_choice 'required' needs at least one tool")
    seen: set[str] = set()
    calls = []
    for f in functions:
        if f.name in seen:
            raise ValueError(f"tools: function names must be unique; {f.name!r} repeats")
        seen.add(f.name)
        calls.append({"type": "object",
                      "properties": {"name": {"const": f.name}, "arguments": _arguments_schema(f)},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class JsonArrayToolParser(ToolParser):
    """Reads `[{"name": "f", "arguments": {...}}, ...]`, the output of `required_tools_schema`."""

    name = "json_array"

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = "start"  # start | element | separator | plain

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        buf, state = self._buf, self._state
        if state == "plain":
            self._emit_content(buf)
            self._buf = ""
            return False
        stripped = self._buf = buf.lstrip()
        ws = buf[:len(buf) - len(stripped)]
        if state == "start":
            self._emit_content(ws)
            if not stripped:
                return False
            if stripped[0] == "[":
                self._begin("[")
                self._buf = stripped[1:]
                self._state = "element"
            else:
                self._state = "plain"
            return True
        if state == "element":
            self._raw += ws
            if stripped.startswith("{"):
                self._reader = JsonCall()
                return True
            if not stripped and not final:
                return False
            self._abandon()
            return True
        # separator: whitespace after a call is dropped
        if not stripped:
            return False
        if stripped[0] == ",":
            self._begin(",")
            self._buf = stripped[1:]
            self._state = "element"
        else:
            if stripped[0] == "]":
                self._buf = stripped[1:]
            self._state = "plain"
        return True

    def _after_call(self) -> None:
        self._state = "separator"

    def _after_break(self) -> None:
        self._state = "plain"


class NamedToolParser(ToolParser):
    """Reads the arguments object of the one function a named tool_choice forces."""

    name = "named"

    def __init__(self, new_id: Callable[[], str] | None = None, *, function_name: str) -> None:
        super().__init__(new_id)
        self._function = function_name
        self._state = "start"  # start | plain

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        buf = self._buf
        if self._state == "plain":
            self._emit_content(buf)
            self._buf = ""
            return False
        stripped = self._buf = buf.lstrip()
        self._emit_content(buf[:len(buf) - len(stripped)])
        if not stripped:
            return False
        self._begin("")
        if stripped[0] == "{":
            self._reader = JsonArguments(self._function)
        else:
            self._state = "plain"
        return True

    def _after_call(self) -> None:
        self._state = "plain"

    def _after_break(self) -> None:
        self._state = "plain"
