"""What a chat request's tools and the server's reasoning parser do to its generation and its
output, for both APIs (OpenAI chat completions, Anthropic messages).

- `ChatParsers`: the server's choice (`--tool-call-parser`, `--enable-auto-tool-choice`,
  `--reasoning-parser`), checked once at start-up.
- `plan_chat_output`: for one request, the grammar that tool_choice `required` or a named
  function imposes (or the user's own), gated so that it applies only after reasoning ends, and
  how each choice's text is to be read.
- `ChatStream`: one choice's text deltas in, ordered `ReasoningText`, `ContentDelta` and
  `ToolCallDelta` events out; `ChatPlan.parse` reads a whole output into a `ParsedChat`.

The reasoning section is read first; tool calls are looked for in the text after it. Where the
reasoning tags are not single tokens in the model's vocabulary, the core cannot tell when reasoning
ends, so a constrained request's grammar applies from its first token and its output is not split
into reasoning at all (it has none: the grammar leaves no room for it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from octavo.engine.grammar import check_structured
from octavo.params import ReasoningEndRule, StructuredOutputsParams
from octavo.serving.reasoning import ReasoningParser, get_reasoning_parser
from octavo.serving.tool_choice import (FunctionSpec, JsonArrayToolParser, NamedToolParser,
                                        named_tool_schema, required_tools_schema)
from octavo.serving.tool_parsers import (ContentDelta, ToolCall, ToolCallDelta, ToolParser,
                                         get_tool_parser)

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ReasoningText:
    text: str


ChatEvent = ReasoningText | ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ChatParsers:
    """The server's tool-call and reasoning parsers (all None: plain text out)."""
    tool_parser: type[ToolParser] | None = None
    auto_tool_choice: bool = False
    reasoning_parser: type[ReasoningParser] | None = None
    reasoning_end: ReasoningEndRule | None = None  # None where the tags are not single tokens

    @classmethod
    def from_flags(cls, tool_call_parser: str | None, enable_auto_tool_choice: bool,
                   reasoning_parser: str | None) -> ChatParsers:
        """Raises ValueError naming the flag (an unknown name lists the choices)."""
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format "
                             "of the model's own tool calls)")
        return cls(get_tool_parser(tool_call_parser) if tool_call_parser else None,
                   enable_auto_tool_choice,
                   get_reasoning_parser(reasoning_parser) if reasoning_parser else None)

    def for_vocab(self, vocab: Mapping[str, int]) -> ChatParsers:
        """With the reasoning parser's token-id rule for this vocabulary (where its tags are
        single tokens)."""
        if self.reasoning_parser is None:
            return self
        return dataclasses.replace(self, reasoning_end=self.reasoning_parser.end_rule(vocab))


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and tool_choice, protocol-neutral (Anthropic's `any` is `required`,
    its `tool` is `named`)."""
    mode: ToolMode
    functions: tuple[FunctionSpec, ...] = ()
    name: str | None = None  # the function of mode `named`
    parallel: bool = True    # False: at most one call


@dataclass(slots=True)
class ParsedChat:
    reasoning: str | None  # None: no reasoning section (or no reasoning parser)
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatStream:
    """One choice's output, read as it streams: reasoning first, then content and tool calls."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 parallel: bool) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._parallel = parallel

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.has_tool_calls

    def feed(self, text: str) -> list[ChatEvent]:
        if self._reasoning is None:
            return self._content(text, final=False)
        delta = self._reasoning.feed(text)
        return self._split(delta.reasoning, delta.content, final=False)

    def finish(self) -> list[ChatEvent]:
        if self._reasoning is None:
            return self._content("", final=True)
        delta = self._reasoning.finish()
        return self._split(delta.reasoning, delta.content, final=True)

    def _split(self, reasoning: str, content: str, final: bool) -> list[ChatEvent]:
        events: list[ChatEvent] = [ReasoningText(reasoning)] if reasoning else []
        return events + self._content(content, final)

    def _content(self, text: str, final: bool) -> list[ChatEvent]:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        if not self._parallel:  # only the first call is kept
            events = [e for e in events if not (isinstance(e, ToolCallDelta) and e.index > 0)]
        return events


@dataclass(frozen=True)
class ChatPlan:
    """How one request is generated (`structured`, `skip_special_tokens`) and read."""
    structured: StructuredOutputsParams | None
    skip_special_tokens: bool | None  # False where the tool-call format needs special tokens
    reasoning_parser: type[ReasoningParser] | None
    tool_parser: type[ToolParser] | None
    tool_options: Mapping[str, Any] = field(default_factory=dict)  # the parser's own options
    new_id: Callable[[], str] | None = None  # tool call ids; None: the parser's default
    parallel: bool = True

    @property
    def reads_reasoning(self) -> bool:
        return self.reasoning_parser is not None

    @property
    def plain(self) -> bool:
        """The output is all content, as generated."""
        return self.reasoning_parser is None and self.tool_parser is None

    def stream(self) -> ChatStream:
        tools = None
        if self.tool_parser is not None:
            tools = self.tool_parser(self.new_id, **self.tool_options)
        return ChatStream(self.reasoning_parser() if self.reasoning_parser else None, tools,
                          self.parallel)

    def parse(self, text: str) -> ParsedChat:
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.parse(text)
            reasoning, text = split.reasoning, split.content
        if self.tool_parser is None:
            return ParsedChat(reasoning, text)
        parsed = self.tool_parser.parse(text, self.new_id, **self.tool_options)
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        return ParsedChat(reasoning, parsed.content, calls)


def check_tool_schemas(functions: Sequence[FunctionSpec], fields: Sequence[str]) -> None:
    """Refuse a function whose parameter schema does not compile to a grammar; `fields` names
    each function's schema for the message. Imports xgrammar on first use: call it in a thread."""
    for function, name in zip(functions, fields):
        if function.parameters is not None:
            check_structured(StructuredOutputsParams(json=named_tool_schema(function)), name)


def plan_chat_output(parsers: ChatParsers, tools: ToolRequest | None,
                     structured: StructuredOutputsParams | None, prompt_ids: Sequence[int],
                     new_id: Callable[[], str] | None = None) -> ChatPlan:
    """Raises ValueError naming the field (`tool_choice`, `tools`)."""
    mode = tools.mode if tools is not None else "none"
    functions = tools.functions if tools is not None else ()
    parallel = tools.parallel if tools is not None else True
    if mode != "none" and not functions:
        raise ValueError(f"tool_choice {mode!r} needs tools")
    if mode in ("required", "named") and structured is not None:
        raise ValueError(f"tool_choice {mode!r} cannot be combined with a structured output "
                         "format (response_format / structured_outputs): both are grammars")
    tool_parser: type[ToolParser] | None = None
    options: dict[str, Any] = {}
    if mode == "auto":
        missing = [flag for flag, ok in (("--enable-auto-tool-choice", parsers.auto_tool_choice),
                                         ("--tool-call-parser", parsers.tool_parser))
                   if not ok]
        if missing:
            raise ValueError(f"tool_choice 'auto' (the default when tools are given) needs the "
                             f"server to run with {' and '.join(missing)}; use tool_choice "
                             f"'required', a named function or 'none' otherwise")
        tool_parser = parsers.tool_parser
        if tool_parser.takes_functions:  # it types the values it reads by the schemas
            options = {"functions": functions}
    elif mode == "required":
        structured = StructuredOutputsParams(
            json=required_tools_schema(functions, parallel), disable_any_whitespace=True)
        tool_parser = JsonArrayToolParser
    elif mode == "named":
        function = next((f for f in functions if f.name == tools.name), None)
        if function is None:
            raise ValueError(f"tool_choice names the function {tools.name!r}, which is not "
                             f"among the tools ({', '.join(f.name for f in functions)})")
        structured = StructuredOutputsParams(json=named_tool_schema(function),
                                             disable_any_whitespace=True)
        tool_parser, options = NamedToolParser, {"function_name": function.name}
    reasoning = parsers.reasoning_parser
    rule = parsers.reasoning_end
    if reasoning is not None and rule is not None and rule.ended_in_prompt(prompt_ids):
        reasoning = None  # the prompt closed the reasoning section: the output has none
    elif reasoning is not None and structured is not None:
        if rule is None:
            reasoning = None  # the grammar applies from the first token: no room to reason
        else:
            structured = dataclasses.replace(structured, reasoning_end=rule)
    skip_special = None
    if any(p is not None and not p.skip_special_tokens
           for p in (tool_parser, parsers.reasoning_parser)):
        skip_special = False
    return ChatPlan(structured, skip_special, reasoning, tool_parser, options, new_id, parallel)
