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

from octavo.serving.tool_parsers.param_call import ParamCallParser, ParamFormat, prefixes

FUNCTION = "<function="
XML_FORMAT = ParamFormat(
    name=re.compile(r"<function=([A-Za-z0-9_.\-]+)>"),
    name_head=re.compile(r"(?:" + prefixes(FUNCTION) + r")|<function=[A-Za-z0-9_.\-]*"),
    parameter=re.compile(r"\s*<parameter=([^<>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL),
    value_open=re.compile(r"<parameter=[^<>\n]*>"),
    undecided=re.compile(prefixes("</function>") + r"|<parameter=[^<>\n]*|"
                         + prefixes("<parameter=")),
    end=re.compile(r"\s*(</function>)"), end_consumed=True, untyped_literal=False)


class Qwen3CoderToolParser(ParamCallParser):
    name = "qwen3_coder"
    call_start = FUNCTION
    format = XML_FORMAT
