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
dropped), typed by the request's tool schemas (param_call.py); a parameter the schemas do not
name stays text.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

from octavo.serving.tool_parsers.hermes import HermesToolParser
from octavo.serving.tool_parsers.param_call import ParamCall, ParamFormat, prefixes

if TYPE_CHECKING:  # tool_choice imports the parsers
    from octavo.serving.tool_choice import FunctionSpec

FUNCTION = "<function="
XML_FORMAT = ParamFormat(
    name=re.compile(r"<function=([A-Za-z0-9_.\-]+)>"),
    name_head=re.compile(r"(?:" + prefixes(FUNCTION) + r")|<function=[A-Za-z0-9_.\-]*"),
    parameter=re.compile(r"\s*<parameter=([^<>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL),
    value_open=re.compile(r"<parameter=[^<>\n]*>"),
    undecided=re.compile(prefixes("</function>") + r"|<parameter=[^<>\n]*|"
                         + prefixes("<parameter=")),
    end=re.compile(r"\s*(</function>)"), end_consumed=True, untyped_literal=False)


class Qwen3CoderToolParser(HermesToolParser):
    name = "qwen3_coder"
    call_start = FUNCTION
    takes_functions = True

    def __init__(self, new_id: Callable[[], str] | None = None,
                 functions: Sequence[FunctionSpec] = ()) -> None:
        super().__init__(new_id)
        self._schemas = {f.name: dict((f.parameters or {}).get("properties") or {})
                         for f in functions}

    def _call_reader(self, text: str) -> ParamCall | None:
        return ParamCall(XML_FORMAT, self._schemas) if text.startswith(FUNCTION) else None
