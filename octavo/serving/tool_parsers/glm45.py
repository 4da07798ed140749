"""GLM-4.5 / 4.6 / 4.7 tool calls: the function's name, then its parameters as key and value
tags, between `<tool_call>` tags:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>[1, 2]</arg_value>
    </tool_call>

The name ends at its newline (or at the first tag, as GLM-4.7 writes it). A value is raw text
typed by the request's tool schemas (param_call.py); a parameter the schemas do not name is read
as JSON or a literal where it is one, else kept as text, as vLLM's glm45 parser reads it.
"""
from __future__ import annotations

import re

from octavo.serving.tool_parsers.hermes import CLOSE
from octavo.serving.tool_parsers.param_call import ParamCallParser, ParamFormat, prefixes

_NAME_CHAR = re.compile(r"[A-Za-z0-9_.\-]")
GLM_FORMAT = ParamFormat(
    name=re.compile(r"([A-Za-z0-9_.\-]+)[ \t]*(?:\n|(?=<))"),
    name_head=re.compile(r"[A-Za-z0-9_.\-]+[ \t]*"),
    parameter=re.compile(r"\s*<arg_key>([^<>]+)</arg_key>\s*<arg_value>(.*?)</arg_value>",
                         re.DOTALL),
    value_open=re.compile(r"<arg_key>[^<>]+</arg_key>\s*<arg_value>"),
    undecided=re.compile(prefixes(CLOSE) + r"|<arg_key>[^<>]*(?:</arg_key>\s*(?:"
                         + prefixes("<arg_value>") + r")?|" + prefixes("</arg_key>") + r")?|"
                         + prefixes("<arg_key>")),
    end=re.compile(r"\s*(" + re.escape(CLOSE) + ")"), end_consumed=False, untyped_literal=True)


class Glm45ToolParser(ParamCallParser):
    name = "glm45"
    call_start = ""  # a name: any of _NAME_CHAR
    format = GLM_FORMAT

    def _starts_call(self, text: str) -> bool:
        return _NAME_CHAR.match(text) is not None
