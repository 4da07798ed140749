"""Hermes / Qwen 2.5 / Qwen 3 tool calls: JSON objects between `<tool_call>` tags, anywhere in the
output and as many as the model likes:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

from typing import Callable

from octavo.serving.tool_parsers.base import CallReader, ToolParser, held_suffix
from octavo.serving.tool_parsers.json_call import JsonCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    call_start = "{"  # what the call inside the tags begins with

    def _call_reader(self, text: str) -> CallReader | None:
        """A reader for the call `text` begins (after the open tag), or None: not one."""
        return JsonCall() if text.startswith(self.call_start) else None

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = "content"   # content | open (after <tool_call>) | close (after a call)

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        buf = self._buf
        if self._state == "open":
            # Whitespace, then the call; anything else means this is not a call.
            stripped = buf.lstrip()
            self._raw += buf[:len(buf) - len(stripped)]
            self._buf = stripped
            reader = self._call_reader(stripped)
            if reader is not None:
                self._reader = reader
                return True
            if not final and self.call_start.startswith(stripped):
                return False
            self._abandon()
            return True
        if self._state == "close":
            # A call ended; its closing tag may follow after whitespace (dropped with it).
            stripped = buf.lstrip()
            self._buf = stripped
            if stripped.startswith(CLOSE):
                self._buf = stripped[len(CLOSE):]
                self._state = "content"
                return True
            if not final and (not stripped or CLOSE.startswith(stripped)):
                return False
            self._state = "content"
            return True
        if not buf:
            return False
        i = buf.find(OPEN)
        if i < 0:
            keep = 0 if final else held_suffix(buf, OPEN)
            self._emit_content(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_content(buf[:i])
        self._buf = buf[i + len(OPEN):]
        self._begin(OPEN)
        self._state = "open"
        return True

    def _after_call(self) -> None:
        self._state = "close"

    def _after_break(self) -> None:
        self._state = "content"
