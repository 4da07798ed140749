"""Qwen3-Coder tool calls: XML-style functions and parameters between `<tool_call>` tags:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    [1, 2]
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its open tag and before its close tag is
dropped), typed by the request's tool schemas as vLLM's qwen3_coder parser types it: a string
parameter keeps its text; integer, number and boolean ones are read as such; others as JSON
(else Python literals), falling back to the text. A parameter the schemas do not name stays
text. The arguments stream one parameter at a time, each once its value is complete.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

from octavo.serving.tool_parsers.hermes import HermesToolParser
from octavo.serving.tool_parsers.json_call import ReadState

if TYPE_CHECKING:  # tool_choice imports the parsers
    from octavo.serving.tool_choice import FunctionSpec

FUNCTION = "<function="
_NAME = re.compile(r"<function=([A-Za-z0-9_.\-]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_END = re.compile(r"\s*</function>")


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as its schema types it (see the module's docstring)."""
    if schema is None:
        return text
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


class XmlCall:
    """One `<function=name>...</function>`, fed a piece at a time; committed once the name is
    read. Its text is re-read whole at each feed: calls are short."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self.text = ""
        self.state = ReadState.READING
        self.name: str | None = None
        self.committed = False
        self._schemas = schemas  # function name -> its parameters' schemas
        self._members: list[str] = []  # '"key": value' of each parameter read

    def feed(self, text: str) -> int:
        """Consume what belongs to the call; a tag it cannot tell yet (`</f...`) is left
        unconsumed until more text comes, so that a break is found at the same character
        however the text was split."""
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
        m = _NAME.match(text)
        if m is None:
            head = re.match(r"<function=[A-Za-z0-9_.\-]*", text)
            if head is None or len(head.group()) < len(text):
                self.state = ReadState.BROKEN
            return len(head.group()) if head else 0
        self.name, self.committed = m[1], True
        at, members = m.end(), []
        properties = self._schemas.get(self.name, {})
        while (p := _PARAMETER.match(text, at)) is not None:
            value = typed_value(p[2], properties.get(p[1]))
            members.append(f"{json.dumps(p[1])}: {json.dumps(value, ensure_ascii=False)}")
            at = p.end()
        self._members = members
        if (e := _END.match(text, at)) is not None:
            self.state = ReadState.DONE
            return e.end()
        rest = text[at:].lstrip()
        if re.match(r"<parameter=[^<>\n]*>", rest):
            return len(text)  # a value being read: anything may follow until its close tag
        if not rest or "</function>".startswith(rest) or re.fullmatch(
                r"<(p(a(r(a(m(e(t(e(r(=[^<>\n]*)?)?)?)?)?)?)?)?)?)?", rest):
            return len(text) - len(rest)  # undecided: wait for the next piece
        self.state = ReadState.BROKEN
        return len(text) - len(rest)

    def finish(self) -> None:
        if self.state is ReadState.READING:
            self.state = ReadState.BROKEN

    def _json(self) -> str:
        return "{" + ", ".join(self._members)

    def arguments_from(self, offset: int) -> str:
        return self._json()[offset:]

    def arguments(self) -> str | None:
        return self._json() + "}" if self.state is ReadState.DONE else None


class Qwen3CoderToolParser(HermesToolParser):
    name = "qwen3_coder"
    call_start = FUNCTION
    takes_functions = True

    def __init__(self, new_id: Callable[[], str] | None = None,
                 functions: Sequence[FunctionSpec] = ()) -> None:
        super().__init__(new_id)
        self._schemas = {f.name: dict((f.parameters or {}).get("properties") or {})
                         for f in functions}

    def _call_reader(self, text: str) -> XmlCall | None:
        return XmlCall(self._schemas) if text.startswith(FUNCTION) else None
