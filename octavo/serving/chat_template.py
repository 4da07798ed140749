"""Render a conversation through a chat template into prompt token ids.

Templates are untrusted Jinja2 code shipped with a model, so they run in Jinja2's immutable
sandbox, with what real templates call: `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, loop controls, and `{% generation %}` blocks (rendered as their body). A render
may be given `RenderLimits`: a deadline, checked on every line the template runs (a trace
function on the template's own frames, so that a loop that writes nothing is stopped too), and a
cap on the characters it writes.
"""
from __future__ import annotations

import datetime
import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from octavo.engine.tokenizer import Tokenizer


class TemplateRaised(Exception):
    """`raise_exception(...)` in a template: the message is meant for the user."""


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    inference only its body matters."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class RenderLimitExceeded(ValueError):
    """A render ran past its deadline or wrote more than its character cap."""


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float
    max_chars: int


_TEMPLATE_FILE = "<template>"  # the code Jinja compiles a template to carries this name


def _render_limited(template: jinja2.Template, context: dict[str, Any],
                    limits: RenderLimits) -> str:
    deadline = time.monotonic() + limits.timeout_s

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderLimitExceeded(f"chat template rendering took longer than "
                                      f"{limits.timeout_s:g} s")
        return on_line

    def on_call(frame, event, arg):  # trace only the template's lines: a third of the cost
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    parts, size = [], 0
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        for part in template.generate(**context):
            size += len(part)
            if size > limits.max_chars:
                raise RenderLimitExceeded(f"the chat template wrote more than "
                                          f"{limits.max_chars} characters")
            parts.append(part)
    finally:
        sys.settrace(previous)
    return "".join(parts)


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


MAX_REPEAT = 1 << 20  # the longest string or list `*` may build (one C call: no deadline sees it)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with `*` and `**` bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                        and len(seq) * count > MAX_REPEAT):
                    raise RenderLimitExceeded(f"the chat template repeats a value past "
                                              f"{MAX_REPEAT} items")
        elif isinstance(right, int) and abs(right) > 1024:
            raise RenderLimitExceeded("the chat template raises a number to a power past 1024")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_text(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                     template: str | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     template_kwargs: dict[str, Any] | None = None,
                     limits: RenderLimits | None = None) -> str:
    """The prompt text of `messages` rendered by `template` (default: the model's own), within
    `limits` if given (else RenderLimitExceeded, a ValueError).

    Message content may be a string or a list of text parts; other part types raise ValueError.
    """
    template = template or tokenizer.chat_template
    if template is None:
        raise ValueError("chat_template: this model has no chat template; pass one")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    conversation = [_plain_message(i, m) for i, m in enumerate(messages)]
    context: dict[str, Any] = {**tokenizer.special_tokens, "tools": None, "documents": None,
                               **(template_kwargs or {})}
    context.update(messages=conversation, add_generation_prompt=add_generation_prompt)
    try:
        compiled = _compile(template)
        text = (compiled.render(**context) if limits is None
                else _render_limited(compiled, context, limits))
    except RenderLimitExceeded:
        raise
    except TemplateRaised as exc:
        raise ValueError(f"chat template failed: {exc}") from None
    except Exception as exc:  # a template error is the request's fault (bad roles, kwargs)
        raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if continue_final_message:
        text = _cut_after_final_message(text, conversation)
    return text


def render_chat(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                limits: RenderLimits | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """Token ids of `messages` rendered by `template`; the template writes any BOS itself
    (`add_special_tokens`: the tokenizer adds its own on top, as vLLM's option does)."""
    text = render_chat_text(tokenizer, messages, template, add_generation_prompt,
                            continue_final_message, template_kwargs, limits)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _plain_message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"messages[{i}] must be an object with a 'role'")
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content[{j}]: content of type {kind!r} is "
                                 "not supported; only 'text'")
            texts.append(str(part.get("text", "")))
        m["content"] = "".join(texts)
    elif content is None:
        m["content"] = ""
    return m


def _cut_after_final_message(text: str, conversation: list[dict[str, Any]]) -> str:
    """Drop what the template wrote after the last message (its end-of-turn tokens), so the
    model continues that message."""
    final = str(conversation[-1]["content"]) if conversation else ""
    stripped = final.strip()
    at = text.rfind(stripped) if stripped else -1
    if at == -1:
        raise ValueError("continue_final_message: the final message does not appear in the "
                         "rendered chat")
    kept = final.lstrip()  # the template may strip the message; keep its trailing space if not
    end = at + (len(kept) if text[at:at + len(kept)] == kept else len(stripped))
    return text[:end]
