"""OpenAI's harmony format (gpt-oss): the output is messages, each a header and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(one line each here; the first message's `<|start|>assistant` is the prompt's). A message
whose header names a recipient `functions.<name>` is a tool call, its body the JSON arguments;
the analysis channel is reasoning (`openai_gptoss`, serving/reasoning.py), the final channel
and commentary without a recipient are the answer. The tags are special tokens: the API layer
keeps them in the text.

`openai` (this parser) reads the calls out of the text the reasoning parser leaves (it passes
a call's message through whole); any other header is content, as every parser's non-calls are.
"""
from __future__ import annotations

import re
from typing import Callable

from octavo.serving.tool_parsers.base import ToolParser, held_suffix
from octavo.serving.tool_parsers.json_call import JsonArguments

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
# What lies between a message's start (after <|start|>, if written) and <|message|>: the role,
# a recipient before or after the channel, and the body's content type.
HEADER = re.compile(r"(?:assistant)?(?:[ \t]*to=([^\s<]+))?[ \t]*<\|channel\|>([A-Za-z_]+)"
                    r"(?:[ \t]+to=([^\s<]+))?(?:[ \t]*(?:<\|constrain\|>)?[ \t]*([A-Za-z_]+))?"
                    r"[ \t]*")
_HEADER_SO_FAR = re.compile(r"(?:[^<\n]|<\|(?:channel|constrain)\|>)*(?:<[^>\n]*)?")
_FUNCTION = re.compile(r"functions\.([A-Za-z0-9_.\-]+)")
_MAX_HEADER = 256  # characters of a header (role, channel, recipient, content type)


def message_head(buf: str, final: bool) -> tuple[str, re.Match[str]] | None | bool:
    """A message header at the start of `buf`: (its text up to and with <|message|>, its
    match), False where `buf` cannot begin one, None where it may but is not complete yet."""
    rest = buf[len(START):] if buf.startswith(START) else buf
    if rest is buf and not buf.startswith(CHANNEL):
        if not final and (START.startswith(buf) or CHANNEL.startswith(buf)):
            return None
        return False
    i = rest.find(MESSAGE)
    if i < 0 or i > _MAX_HEADER:  # one limit, so that streamed and whole reads agree
        if not final and i < 0 and len(rest) <= _MAX_HEADER and _HEADER_SO_FAR.fullmatch(rest):
            return None
        return False
    m = HEADER.fullmatch(rest[:i])
    if m is None:
        return False
    return buf[:len(buf) - len(rest) + i + len(MESSAGE)], m


def recipient(m: re.Match[str]) -> str | None:
    return m[1] or m[3]


class HarmonyToolParser(ToolParser):
    name = "openai"
    skip_special_tokens = False

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = "content"  # content | header (at a tag) | after (a call's arguments)

    def _advance(self, final: bool) -> bool:
        if self._reader is not None:
            return self._read_call(final)
        buf = self._buf
        if self._state == "after":  # the call's end tag, if written
            for tag in (CALL, END):
                if buf.startswith(tag):
                    self._buf = buf[len(tag):]
                    break
            else:
                if not final and (not buf or any(t.startswith(buf) for t in (CALL, END))):
                    return False
            self._state = "content"
            return True
        if self._state == "header":
            head = message_head(buf, final)
            if head is None:
                return False
            tag = START if buf.startswith(START) else CHANNEL
            function = _FUNCTION.fullmatch(recipient(head[1]) or "") if head else None
            if function is None:  # no header, or no function's: its text is content
                text = head[0] if head else tag
                self._emit_content(text)
                self._buf = buf[len(text):]
                self._state = "content"
                return True
            body = buf[len(head[0]):]
            if not body and not final:
                return False  # the arguments' first character decides
            self._begin(head[0])
            self._state = "content"
            if not body.startswith("{"):
                self._buf = body
                self._abandon()
                return True
            self._buf = body
            self._reader = JsonArguments(function[1])
            return True
        found = [i for tag in (START, CHANNEL) if (i := buf.find(tag)) >= 0]
        if not found:
            keep = 0 if final else max(held_suffix(buf, START), held_suffix(buf, CHANNEL))
            self._emit_content(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        i = min(found)
        self._emit_content(buf[:i])
        self._buf = buf[i:]
        self._state = "header"
        return True

    def _after_call(self) -> None:
        self._state = "after"

    def _after_break(self) -> None:
        self._state = "content"
