"""Mistral tool calls, after the `[TOOL_CALLS]` token, in either of Mistral's two formats:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}            (v11 and later)

`[TOOL_CALLS]` and `[ARGS]` are special tokens: the API layer must detokenize with special tokens
kept (`skip_special_tokens = False`). In case they were skipped anyway, an output that starts with a
JSON array of objects is still tried as the older format. Mistral's chat templates want call ids of
exactly 9 letters and digits, so that is this parser's default id.
"""
from __future__ import annotations

import re
from typing import Callable

from octavo.serving.tool_parsers.base import ToolParser, held_suffix, tool_call_id
from octavo.serving.tool_parsers.json_call import JsonArguments, JsonCall

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"  # some versions write the call's id between the name and [ARGS]
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        # content | after_tag | element (an array's next object) | array_sep | name | call_id
        # | args (the arguments object of a v11 call)
        self._state = "content"
        self._at_start = True     # nothing but whitespace seen yet
        self._name = ""
        self._in_array = False    # reading the older format's array of call objects

    @staticmethod
    def default_id() -> str:
        return tool_call_id("", 9)

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        state = self._state
        if state == "content":
            return self._content(final)
        if state == "array_sep":  # whitespace after a call is dropped
            stripped = self._buf = self._buf.lstrip()
            if not stripped:
                return False
            if stripped[0] == ",":
                self._begin(",")
                self._buf = stripped[1:]
                self._state = "element"
            else:
                if stripped[0] == "]":
                    self._buf = stripped[1:]
                self._state = "content"
            return True
        if state in ("after_tag", "element", "args"):
            buf = self._buf
            stripped = self._buf = buf.lstrip()
            self._raw += buf[:len(buf) - len(stripped)]
            if not stripped:
                if final:
                    self._abandon()
                return final
            ch = stripped[0]
            if state == "after_tag" and ch == "[":
                self._raw += ch
                self._buf = stripped[1:]
                self._state = "element"
            elif state == "after_tag" and _NAME.match(ch).end():
                self._name = ""
                self._state = "name"
            elif ch == "{":  # after the tag itself: one call object without the array
                self._in_array = state == "element"
                self._reader = JsonArguments(self._name) if state == "args" else JsonCall()
            else:
                self._abandon()
            return True
        return self._name_part(final)

    def _content(self, final: bool) -> bool:
        buf = self._buf
        if self._at_start:
            # Special tokens skipped: an output that is a JSON array of objects may be calls.
            stripped = buf.lstrip()
            if not stripped:
                self._emit_content(buf)
                self._buf = ""
                return False
            rest = stripped[1:].lstrip()
            if stripped[0] == "[" and not rest and not final:
                return False
            self._at_start = False
            if stripped[0] == "[" and rest.startswith("{"):
                self._emit_content(buf[:len(buf) - len(stripped)])
                self._begin(stripped[:len(stripped) - len(rest)])
                self._buf = rest
                self._state = "element"
                return True
        if not buf:
            return False
        i = buf.find(TOOL_CALLS)
        if i < 0:
            keep = 0 if final else held_suffix(buf, TOOL_CALLS)
            self._emit_content(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_content(buf[:i])
        self._buf = buf[i + len(TOOL_CALLS):]
        self._begin(TOOL_CALLS)
        self._state = "after_tag"
        self._at_start = False
        return True

    def _name_part(self, final: bool) -> bool:
        """The v11 format: the name, maybe [CALL_ID] and an id, then [ARGS] (or the object)."""
        buf = self._buf
        n = _NAME.match(buf).end()
        self._raw += buf[:n]
        if self._state == "name":
            self._name += buf[:n]
        buf = self._buf = buf[n:]
        if not buf:
            if final:
                self._abandon()
            return final
        for tag, state in ((ARGS, "args"), (CALL_ID, "call_id")):
            if buf.startswith(tag) and not (state == "call_id" and self._state == "call_id"):
                self._raw += tag
                self._buf = buf[len(tag):]
                self._state = state
                return True
            if tag.startswith(buf) and not final:
                return False
        if buf[0] == "{":  # some versions write no [ARGS]
            self._state = "args"
            return True
        self._abandon()
        return True

    def _after_call(self) -> None:
        self._state = "array_sep" if self._in_array else "content"

    def _after_break(self) -> None:
        self._state = "content"
