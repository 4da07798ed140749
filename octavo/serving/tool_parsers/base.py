"""The tool-call parser interface, its protocol-neutral output types, and the machinery shared by
every format: holding back text that may still turn into a call, whitespace around calls,
announcing a call and streaming its arguments, and falling back to plain text.

A parser is fed the model's text as deltas (`feed`, then `finish` once at the end) and returns
events in output order: `ContentDelta` (plain text) and `ToolCallDelta` (the first delta of a call
carries its index, id and name; later ones carry argument fragments whose concatenation is the
arguments' JSON text). `parse` reads a whole output in one go with the same state machine, so a
streamed and a whole parse agree.

Rules every format follows:
- Text that may still become part of a call (a partial tag, a call being read) is held back, never
  sent as content first.
- A call is announced once its name is known and its arguments object has begun; from then on its
  arguments stream as the model writes them.
- Something that looks like a call but is not one (bad JSON, unknown structure) is plain content,
  character for character, never an exception. If a call breaks after it was announced (the output
  is cut off inside the arguments, or they stop being JSON), the stream cannot take back what it
  sent: the call ends with the arguments sent so far and the rest of its text follows as content.
  The whole-output parse returns such a call's text as content instead; that is the one case where
  the two differ.
- Whitespace between text and a call, between calls, and after the last call is dropped; all other
  text is kept.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

from octavo.serving.tool_parsers.json_call import ReadState

_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id(prefix: str = "call_", length: int = 24) -> str:
    """A random call id such as OpenAI's `call_...` (Anthropic uses the prefix `toolu_`)."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int                 # the call's position among this output's calls, from 0
    id: str | None = None      # set on a call's first delta only
    name: str | None = None    # set on a call's first delta only
    arguments: str = ""        # the next fragment of the arguments' JSON text


StreamEvent = ContentDelta | ToolCallDelta


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True)
class ParsedToolCalls:
    content: str                          # the text outside calls ("" when there is none)
    tool_calls: list[ToolCall] = field(default_factory=list)


class CallReader(Protocol):
    """What the shared code needs from a reader of one call (see json_call.py)."""
    text: str  # everything it consumed
    state: ReadState
    name: str | None
    committed: bool

    def feed(self, text: str) -> int: ...
    def finish(self) -> None: ...
    def arguments_from(self, offset: int) -> str: ...
    def arguments(self) -> str | None: ...


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """Base class: subclasses implement `_advance` for their format."""

    name: ClassVar[str] = ""
    # Whether the format survives detokenizing with special tokens skipped; where it does not
    # (Mistral's [TOOL_CALLS] is a special token), the API layer must keep them.
    skip_special_tokens: ClassVar[bool] = True
    # Whether it takes the request's tools (`functions=`, FunctionSpec) to type what it reads.
    takes_functions: ClassVar[bool] = False

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self._new_id = new_id or self.default_id
        self._buf = ""                    # received text not yet decided
        self._events: list[StreamEvent] = []
        self._segments: list[str | ToolCall] = []  # the whole-output view, in order
        self._pending_ws = ""             # whitespace after content; dropped if a call follows
        self._skip_ws = False             # drop whitespace right after a call
        self._reader: CallReader | None = None
        self._raw = ""                    # text of the call being tried, as the model wrote it
        self._call: ToolCall | None = None    # the announced call being streamed
        self._call_ws = ""                # whitespace dropped when `_call` was announced
        self._sent = 0                    # characters of `_call`'s arguments sent so far
        self._num_announced = 0
        self._finished = False

    @staticmethod
    def default_id() -> str:
        return tool_call_id()

    # ---- public interface ----

    def feed(self, text: str) -> list[StreamEvent]:
        """Take the next text delta; returns the events it completes, in order."""
        if self._finished:
            raise ValueError("tool-call parser: feed() after finish()")
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> list[StreamEvent]:
        """The output has ended: decide everything held back."""
        if not self._finished:
            self._finished = True
            self._step(final=True)
            self._flush_ws()
        return self._take()

    @property
    def has_tool_calls(self) -> bool:
        """Whether a call has been announced (for finish_reason "tool_calls")."""
        return self._num_announced > 0

    @classmethod
    def parse(cls, text: str, new_id: Callable[[], str] | None = None,
              **options: Any) -> ParsedToolCalls:
        """Split a whole output into its content and its valid calls (`options` go to the
        constructor)."""
        parser = cls(new_id, **options)
        parser.feed(text)
        parser.finish()
        content = "".join(s for s in parser._segments if isinstance(s, str))
        return ParsedToolCalls(content, [s for s in parser._segments if isinstance(s, ToolCall)])

    # ---- for subclasses ----

    def _advance(self, final: bool) -> bool:
        """Make progress on `self._buf`; False when it must wait for more text (or, at the end,
        when nothing is left)."""
        raise NotImplementedError

    def _after_call(self) -> None:
        """A call ended well; set the state that follows it."""

    def _after_break(self) -> None:
        """A call attempt failed; set the state that follows it (its text was made content)."""

    def _step(self, final: bool) -> None:
        while self._advance(final):
            pass

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._skip_ws:
            stripped = text.lstrip()
            if not stripped:
                return
            text, self._skip_ws = stripped, False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        self._add_content(self._pending_ws + body)
        self._pending_ws = text[len(body):]

    def _flush_ws(self) -> None:
        if self._pending_ws:
            self._add_content(self._pending_ws)
            self._pending_ws = ""

    def _add_content(self, text: str) -> None:
        self._events.append(ContentDelta(text))
        if self._segments and isinstance(self._segments[-1], str):
            self._segments[-1] += text
        else:
            self._segments.append(text)

    def _begin(self, raw: str) -> None:
        """Start trying a call whose opening text (tag, separator) is `raw`."""
        self._raw = raw

    def _abandon(self) -> None:
        """The text tried as a call is not one: it is content."""
        raw, self._raw = self._raw, ""
        self._emit_content(raw)
        self._after_break()

    def _announce(self, name: str) -> None:
        self._call = ToolCall(self._new_id(), name, "")
        self._call_ws, self._pending_ws = self._pending_ws, ""
        self._sent = 0
        self._events.append(ToolCallDelta(self._num_announced, self._call.id, name))
        self._num_announced += 1

    def _stream_arguments(self, fragment: str) -> None:
        """Send the next piece of the announced call's arguments."""
        if fragment:
            self._events.append(ToolCallDelta(self._num_announced - 1, arguments=fragment))
            self._sent += len(fragment)

    def _complete(self, name: str, arguments: str) -> None:
        """A call ended well with these arguments."""
        if self._call is None:
            self._announce(name)
        self._stream_arguments(arguments[self._sent:])
        self._call.arguments = arguments
        self._segments.append(self._call)
        self._call, self._raw, self._skip_ws = None, "", True
        self._after_call()

    def _read_call(self, final: bool) -> bool:
        """Feed the current reader; announce, stream, complete or give up on its call."""
        reader = self._reader
        n = reader.feed(self._buf)
        self._buf = self._buf[n:]
        if final and reader.state is ReadState.READING:
            reader.finish()
        # Announce as soon as the reader commits, even if it broke later in the same delta, so
        # that every split of the text into deltas streams the same events.
        if reader.committed and self._call is None:
            self._announce(reader.name)
        if reader.state is ReadState.READING:
            if self._call is not None:
                self._stream_arguments(reader.arguments_from(self._sent))
            return False
        self._reader = None
        if reader.state is ReadState.DONE:
            self._complete(reader.name, reader.arguments())
            return True
        self._raw += reader.text  # the reader keeps what it consumed; only now is it needed
        if self._call is not None:
            # Announced, then broken: what was sent stays sent; the rest is content.
            self._stream_arguments(reader.arguments_from(self._sent))
            self._segments.append(self._call_ws + self._raw)
            self._call, self._raw = None, ""
            self._after_break()
        else:
            self._abandon()
        return True

    def _take(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        merged: list[StreamEvent] = []
        for e in events:
            last = merged[-1] if merged else None
            if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
                last.text += e.text
            elif (isinstance(e, ToolCallDelta) and isinstance(last, ToolCallDelta)
                  and e.index == last.index and e.id is None):
                last.arguments += e.arguments
            else:
                merged.append(e)
        return merged
