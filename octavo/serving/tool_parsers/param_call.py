"""Tool calls written as a name and tagged parameters, each value raw text typed by the request's
tool schemas (Qwen3-Coder's `<function=…><parameter=…>`, GLM-4.5's `name<arg_key>…<arg_value>…`):
the reader shared by their parsers, each format a `ParamFormat` of patterns.

A value is typed as vLLM's parsers for these formats type it: a string parameter keeps its text;
integer, number and boolean ones are read as such; others as JSON (else Python literals), falling
back to the text. A parameter the schemas do not name stays text, or, in formats that say so
(`untyped_literal`: GLM-4.5), is read as JSON or a literal where it is one. The arguments stream
one parameter at a time, each once its value is complete.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from octavo.serving.tool_parsers.hermes import HermesToolParser
from octavo.serving.tool_parsers.json_call import ReadState

if TYPE_CHECKING:  # tool_choice imports the parsers
    from octavo.serving.tool_choice import FunctionSpec


def typed_value(text: str, schema: Mapping[str, Any] | None, untyped_literal: bool) -> Any:
    """A parameter's text as its schema types it (see the module's docstring); without a schema,
    the text, or the literal it spells where `untyped_literal`."""
    if schema is None:
        return _literal(text) if untyped_literal else text
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    if kind in (None, "string"):
        return text if kind == "string" or "enum" in schema else _literal(text)
    if text.strip().lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(text.strip())
        if kind == "number":
            number = float(text.strip())
            return int(number) if number.is_integer() and "." not in text else number
    except ValueError:
        return text
    if kind == "boolean":
        word = text.strip().lower()
        return word == "true" if word in ("true", "false") else text
    return _literal(text)


def _literal(text: str) -> Any:
    for read in (json.loads, ast.literal_eval):
        try:
            return read(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


@dataclass(frozen=True)
class ParamFormat:
    """A format's patterns, each matched at a position of the call's text."""

    name: re.Pattern[str]            # the name, with what ends it; group 1 is the name
    name_head: re.Pattern[str]       # a name not ended yet (fullmatch of the text so far)
    parameter: re.Pattern[str]       # one whole parameter: groups 1 and 2, key and value
    value_open: re.Pattern[str]      # a parameter whose value is being read: wait for it
    undecided: re.Pattern[str]       # a partial tag at the end (fullmatch): wait
    end: re.Pattern[str]             # what ends the call; group 1: its tag
    end_consumed: bool               # whether the call takes the tag (else the parser does)
    untyped_literal: bool            # how a parameter without a schema reads (typed_value)


class ParamCall:
    """One call of a `ParamFormat`, fed a piece at a time; committed once its name is read. Its
    text is re-read whole at each feed: calls are short."""

    def __init__(self, fmt: ParamFormat, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self.text = ""
        self.state = ReadState.READING
        self.name: str | None = None
        self.committed = False
        self._fmt = fmt
        self._schemas = schemas  # function name -> its parameters' schemas
        self._members: list[str] = []  # '"key": value' of each parameter read
        self._between = False  # what it read ends between parameters (nothing undecided)

    def feed(self, text: str) -> int:
        """Consume what belongs to the call; a tag it cannot tell yet is left unconsumed until
        more text comes, so that a break is found at the same character however the text was
        split."""
        if self.state is not ReadState.READING:
            return 0
        start = len(self.text)
        whole = self.text + text
        end = self._scan(whole)
        self.text = whole[:end]
        return end - start

    def _scan(self, text: str) -> int:
        """How much of `text` the call takes: all of it (DONE, or BROKEN at the first character
        that cannot belong to it), or, while it goes on, all but an undecided tag at its end."""
        fmt = self._fmt
        m = fmt.name.match(text)
        if m is None:
            if fmt.name_head.fullmatch(text) is None:
                self.state = ReadState.BROKEN
            return 0
        self.name, self.committed = m[1], True
        at, members = m.end(), []
        properties = self._schemas.get(self.name, {})
        while (p := fmt.parameter.match(text, at)) is not None:
            value = typed_value(p[2], properties.get(p[1]), fmt.untyped_literal)
            members.append(f"{json.dumps(p[1])}: {json.dumps(value, ensure_ascii=False)}")
            at = p.end()
        self._members = members
        if (e := fmt.end.match(text, at)) is not None:
            self.state = ReadState.DONE
            return e.end() if fmt.end_consumed else e.start(1)
        rest = text[at:].lstrip()
        self._between = not rest
        if fmt.value_open.match(rest):
            return len(text)  # a value being read: anything may follow until its close tag
        if not rest or fmt.undecided.fullmatch(rest):
            return len(text) - len(rest)  # undecided: wait for the next piece
        self.state = ReadState.BROKEN
        return len(text) - len(rest)

    def finish(self) -> None:
        """The output ended: a call whose name and parameters are whole lacks only its closing
        tag, which is forgiven (as Hermes' missing brace is); anything else broke."""
        if self.state is ReadState.READING:
            self.state = ReadState.DONE if self.committed and self._between else ReadState.BROKEN

    def _json(self) -> str:
        return "{" + ", ".join(self._members)

    def arguments_from(self, offset: int) -> str:
        return self._json()[offset:]

    def arguments(self) -> str | None:
        return self._json() + "}" if self.state is ReadState.DONE else None


def prefixes(tag: str) -> str:
    """A pattern matching every non-empty prefix of `tag` (an undecided partial tag)."""
    return "|".join(re.escape(tag[:n]) for n in range(len(tag), 0, -1))


class ParamCallParser(HermesToolParser):
    """Hermes' tags around a call of a `ParamFormat`, its values typed by the request's tool
    schemas (`takes_functions`): a subclass names its format and what a call starts with."""

    takes_functions = True
    format: ClassVar[ParamFormat]

    def __init__(self, new_id: Callable[[], str] | None = None,
                 functions: Sequence[FunctionSpec] = ()) -> None:
        super().__init__(new_id)
        self._schemas = {f.name: dict((f.parameters or {}).get("properties") or {})
                         for f in functions}

    def _starts_call(self, text: str) -> bool:
        return text.startswith(self.call_start)

    def _call_reader(self, text: str) -> ParamCall | None:
        return ParamCall(self.format, self._schemas) if self._starts_call(text) else None
