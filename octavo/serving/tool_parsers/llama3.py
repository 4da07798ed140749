"""Llama 3.x JSON tool calls: the output begins with a JSON call object, optionally after
`<|python_tag|>`; several calls are separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

Calls count only at the start of the output: JSON later in a text answer is just text.
`<|python_tag|>` is a special token, so it is only seen when special tokens are kept; the parser
works either way.
"""
from __future__ import annotations

from typing import Callable

from octavo.serving.tool_parsers.base import ToolParser
from octavo.serving.tool_parsers.json_call import JsonCall

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        # start | expect (a call object must come next) | separator (after a call) | plain
        self._state = "start"

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        buf, state = self._buf, self._state
        if state == "plain":
            self._emit_content(buf)
            self._buf = ""
            return False
        stripped = buf.lstrip()
        ws = buf[:len(buf) - len(stripped)]
        self._buf = stripped
        if state == "separator":  # whitespace after a call is dropped
            if not stripped:
                return False
            if stripped[0] == ";":
                self._begin(";")
                self._buf = stripped[1:]
                self._state = "expect"
            elif stripped[0] == "{":
                self._begin("")
                self._state = "expect"
            else:
                self._state = "plain"
            return True
        if state == "start":
            self._emit_content(ws)  # held as pending whitespace until we know what follows
            if not stripped:
                return False
            if stripped.startswith(PYTHON_TAG):
                self._begin(PYTHON_TAG)
                self._buf = stripped[len(PYTHON_TAG):]
                self._state = "expect"
                return True
            if PYTHON_TAG.startswith(stripped) and not final:
                return False
            if stripped[0] == "{":
                self._begin("")
                self._reader = JsonCall()
            else:
                self._state = "plain"
            return True
        # expect
        self._raw += ws
        if stripped.startswith("{"):
            self._reader = JsonCall()
            return True
        if not stripped and not final:
            return False
        self._abandon()
        return True

    def _after_call(self) -> None:
        self._state = "separator"

    def _after_break(self) -> None:
        self._state = "plain"
