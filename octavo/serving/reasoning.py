"""Reasoning parsers: split a model's output into reasoning (`<think>…</think>`) and the answer.

- `deepseek_r1`: everything up to `</think>` is reasoning. The `<think>` start tag is optional,
  because the chat template may already have put it in the prompt.
- `qwen3` and `glm45`: reasoning only when the output starts with `<think>`; without it, all is
  content.
- `openai_gptoss`: OpenAI's harmony messages (gpt-oss): the analysis channel is reasoning
  (`HarmonyReasoningParser`).

A parser is fed text deltas (`feed`, then `finish` once) and returns `ReasoningDelta`s, reasoning
text before content text; `parse` reads a whole output with the same state machine. Text that may
be the start of a tag is held back until it is decided, so tags split across deltas anywhere are
found. Whitespace right inside the tags and right after `</think>` is dropped; everything else is
kept. `reasoning_ended` says when the answer has begun (structured output applies from there);
`end_rule` builds the `ReasoningEndRule` (octavo/params.py) that decides the same from token ids
alone, for the engine core's grammar gate.

Run the tool-call parser, if any, on the content this parser returns.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from octavo.params import ReasoningEndRule
from octavo.serving.tool_parsers import harmony
from octavo.serving.tool_parsers.base import held_suffix

_START, _REASONING, _CONTENT = range(3)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""   # comes before `content` in the output
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(slots=True)
class ParsedReasoning:
    reasoning: str | None  # None when the output has no reasoning section
    content: str


class ReasoningParser:
    """The `<think>…</think>` state machine; subclasses set whether the start tag is required."""

    name: ClassVar[str] = ""
    # Whether its tags survive detokenizing with special tokens skipped (harmony's do not).
    skip_special_tokens: ClassVar[bool] = True
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    start_required: ClassVar[bool] = False

    def __init__(self) -> None:
        self._state = _START
        self._buf = ""
        self._pending_ws = ""      # whitespace at the end of the reasoning so far
        self._skip_ws = False      # drop whitespace at the start of a section
        self._had_reasoning = False
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """True once the text after the reasoning (or, with no reasoning, the output) began."""
        return self._state == _CONTENT

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise ValueError("reasoning parser: feed() after finish()")
        self._buf += text
        out = ReasoningDelta()
        self._step(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if not self._finished:
            self._finished = True
            self._step(out, final=True)
            if self._pending_ws:
                out.reasoning += self._pending_ws
                self._pending_ws = ""
        return out

    @classmethod
    def parse(cls, text: str) -> ParsedReasoning:
        parser = cls()
        first, last = parser.feed(text), parser.finish()
        reasoning = first.reasoning + last.reasoning
        return ParsedReasoning(reasoning if parser._had_reasoning else None,
                               first.content + last.content)

    @classmethod
    def end_rule(cls, vocab: Mapping[str, int]) -> ReasoningEndRule | None:
        """The token-id rule for a tokenizer's vocabulary, or None if a tag is not one token."""
        start, end = vocab.get(cls.start_tag), vocab.get(cls.end_tag)
        if start is None or end is None:
            return None
        return ReasoningEndRule(start, end, cls.start_required)

    def _step(self, out: ReasoningDelta, final: bool) -> None:
        if self._state == _START:
            stripped = self._buf.lstrip()
            if stripped.startswith(self.start_tag):
                self._buf = stripped[len(self.start_tag):]
                self._enter_reasoning()
            elif not final and self.start_tag.startswith(stripped):
                return  # empty or a partial start tag: wait
            elif self.start_required:
                self._state = _CONTENT
            else:
                self._enter_reasoning()
        if self._state == _REASONING:
            buf = self._buf
            i = buf.find(self.end_tag)
            if i >= 0:
                self._add_reasoning(out, buf[:i])
                self._pending_ws = ""  # whitespace before </think> is dropped
                self._buf = buf[i + len(self.end_tag):]
                self._state, self._skip_ws = _CONTENT, True
            else:
                keep = 0 if final else held_suffix(buf, self.end_tag)
                self._add_reasoning(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return
        if self._state == _CONTENT:
            text, self._buf = self._buf, ""
            if self._skip_ws:
                text = text.lstrip()
                self._skip_ws = not text
            out.content += text

    def _enter_reasoning(self) -> None:
        self._state, self._skip_ws, self._had_reasoning = _REASONING, True, True

    def _add_reasoning(self, out: ReasoningDelta, text: str) -> None:
        """Add reasoning text; its trailing whitespace waits until we know a tag does not follow."""
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if body:
            out.reasoning += self._pending_ws + body
            self._pending_ws = ""
        self._pending_ws += text[len(body):]


class HarmonyReasoningParser(ReasoningParser):
    """OpenAI's harmony messages (gpt-oss; serving/tool_parsers/harmony.py): the analysis
    channel's bodies are reasoning; the final channel's and commentary without a recipient are
    content, their headers and end tags dropped; a message to a recipient (a tool call) passes
    into the content whole, header and end tag too, for the `openai` tool-call parser. Output
    that does not begin as a harmony message is content as it is. Its reasoning ends with a
    run of tokens, not one tag: the core's grammar gate cannot tell when (`end_rule` is None)."""

    name = "openai_gptoss"
    skip_special_tokens = False

    def __init__(self) -> None:
        super().__init__()
        self._state = "header"  # header | body | plain
        self._kind = "content"  # the body's: reasoning | content | raw (a call, passed whole)
        self._ended = False

    @property
    def reasoning_ended(self) -> bool:
        return self._ended

    @classmethod
    def end_rule(cls, vocab: Mapping[str, int]) -> ReasoningEndRule | None:
        return None

    def _step(self, out: ReasoningDelta, final: bool) -> None:
        while self._buf:
            if self._state == "plain":
                out.content += self._buf
                self._buf = ""
            elif self._state == "header" and not self._header(out, final):
                return
            elif self._state == "body" and not self._body(out, final):
                return

    def _header(self, out: ReasoningDelta, final: bool) -> bool:
        head = harmony.message_head(self._buf, final)
        if head is None:
            return False
        if head is False:
            self._state, self._ended = "plain", True
            return True
        text, m = head
        self._buf = self._buf[len(text):]
        if harmony.recipient(m):
            self._kind = "raw"
            out.content += text
        else:
            self._kind = "reasoning" if m[2] == "analysis" else "content"
            self._had_reasoning |= self._kind == "reasoning"
        self._ended |= self._kind != "reasoning"
        self._state = "body"
        return True

    def _body(self, out: ReasoningDelta, final: bool) -> bool:
        buf = self._buf
        found = [(i, t) for t in (*harmony.TERMINATORS, harmony.START, harmony.CHANNEL)
                 if (i := buf.find(t)) >= 0]
        if not found:
            keep = 0 if final else max(held_suffix(buf, t) for t in (
                *harmony.TERMINATORS, harmony.START, harmony.CHANNEL))
            self._emit_body(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        i, tag = min(found)
        self._emit_body(out, buf[:i])
        if tag in harmony.TERMINATORS:
            if self._kind == "raw":
                out.content += tag
            i += len(tag)
        self._buf = buf[i:]  # a message that began without the last one's end tag: its header
        self._state = "header"
        return True

    def _emit_body(self, out: ReasoningDelta, text: str) -> None:
        if self._kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start_required = True


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    start_required = True


REASONING_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType({
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                              Glm45ReasoningParser, HarmonyReasoningParser)
})


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; "
                         f"choose one of {', '.join(sorted(REASONING_PARSERS))}") from None
