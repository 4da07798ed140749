"""Tool calls written as tags around a function name and its JSON arguments, optionally inside a
section of calls (Kimi K2, DeepSeek V3 and V3.1):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

One state machine (`TaggedCallParser`) reads them all; a format is its tags. The tags are special
tokens: the API layer must detokenize with special tokens kept (`skip_special_tokens = False`).
A section tag or call tag not followed by a well-formed call is content, as every parser's is.
"""
from __future__ import annotations

import re
from typing import Callable, ClassVar

from octavo.serving.tool_parsers.base import ToolParser, held_suffix
from octavo.serving.tool_parsers.json_call import JsonArguments

_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:\-]*")


class TaggedCallParser(ToolParser):
    skip_special_tokens = False
    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]  # before the name
    name_end: ClassVar[str]  # between the name and the arguments (whitespace around it is ok)
    args_end: ClassVar[str] = ""  # after the arguments, before call_end (a code fence's close)
    call_end: ClassVar[str]

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        # content | section (after section_begin) | name | after (a call's arguments ended)
        self._state = "content"

    def _function_name(self, written: str) -> str | None:
        """The function's name as the model wrote it between the tags; None: not a name."""
        return written or None

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        if self._state == "content":
            return self._content(final)
        if self._state == "section":
            return self._call_after_section(final)
        if self._state == "name":
            return self._name(final)
        return self._after(final)

    def _content(self, final: bool) -> bool:
        buf = self._buf
        found = [(i, tag) for tag in (self.section_begin, self.call_begin)
                 if (i := buf.find(tag)) >= 0]
        if not found:
            keep = 0 if final else max(held_suffix(buf, self.section_begin),
                                       held_suffix(buf, self.call_begin))
            self._emit_content(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        i, tag = min(found)
        self._emit_content(buf[:i])
        self._buf = buf[i + len(tag):]
        self._begin(tag)
        self._state = "section" if tag == self.section_begin else "name"
        return True

    def _call_after_section(self, final: bool) -> bool:
        """Whitespace, then a call's tag; without it, the section tag was no call: content."""
        buf = self._buf
        stripped = self._buf = buf.lstrip()
        self._raw += buf[:len(buf) - len(stripped)]
        if stripped.startswith(self.call_begin):
            self._raw += self.call_begin
            self._buf = stripped[len(self.call_begin):]
            self._state = "name"
            return True
        if not final and self.call_begin.startswith(stripped):
            return False
        self._abandon()
        return True

    def _name(self, final: bool) -> bool:
        buf = self._buf
        written = buf[:_NAME_CHARS.match(buf).end()]
        rest = buf[len(written):].lstrip()
        if not rest.startswith(self.name_end):
            if not final and (not rest or self.name_end.startswith(rest)):
                return False  # the name or its end tag is still coming
            self._abandon()
            return True
        name = self._function_name(written)
        if name is None:
            self._abandon()
            return True
        args = rest[len(self.name_end):].lstrip()
        if not args and not final:
            return False  # the arguments' first character decides: wait for it
        if not args.startswith("{"):  # arguments are an object, or this is no call
            self._abandon()
            return True
        self._raw += buf[:len(buf) - len(args)]
        self._buf = args
        self._reader = JsonArguments(name)
        return True

    def _after(self, final: bool) -> bool:
        """After a call's arguments: the fence's close and the call's end tag (either may be
        missing), then another call, the section's end, or content."""
        for tag in (self.args_end, self.call_end):
            if not tag:
                continue
            stripped = self._buf.lstrip()
            if stripped.startswith(tag):
                self._buf = stripped[len(tag):]
            elif not final and (not stripped or tag.startswith(stripped)):
                return False
        stripped = self._buf.lstrip()
        if not final and any(t.startswith(stripped) and t != stripped
                             for t in (self.call_begin, self.section_end)):
            return False
        self._buf = stripped
        if stripped.startswith(self.call_begin):
            self._buf = stripped[len(self.call_begin):]
            self._begin(self.call_begin)
            self._state = "name"
            return True
        if stripped.startswith(self.section_end):
            self._buf = stripped[len(self.section_end):]
        self._state = "content"
        return True

    def _after_call(self) -> None:
        self._state = "after"

    def _after_break(self) -> None:
        self._state = "content"


class KimiK2ToolParser(TaggedCallParser):
    name = "kimi_k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    name_end = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    _ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+):\d+")

    def _function_name(self, written: str) -> str | None:
        """Kimi writes `functions.<name>:<index>`."""
        m = self._ID.fullmatch(written)
        return m[1] if m else None


class DeepSeekV3ToolParser(TaggedCallParser):
    name = "deepseek_v3"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    name_end = "```json"
    args_end = "```"
    call_end = "<｜tool▁call▁end｜>"


class DeepSeekV31ToolParser(TaggedCallParser):
    name = "deepseek_v31"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    name_end = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"
