"""Tool-call parsers: turn a model's own tool-call format into protocol-neutral calls, streamed or
whole. `get_tool_parser(name)` picks one by its `--tool-call-parser` name."""
from __future__ import annotations

from types import MappingProxyType

from octavo.serving.tool_parsers.base import (ContentDelta, ParsedToolCalls, StreamEvent, ToolCall,
                                              ToolCallDelta, ToolParser, tool_call_id)
from octavo.serving.tool_parsers.glm45 import Glm45ToolParser
from octavo.serving.tool_parsers.harmony import HarmonyToolParser
from octavo.serving.tool_parsers.hermes import HermesToolParser
from octavo.serving.tool_parsers.llama3 import Llama3JsonToolParser
from octavo.serving.tool_parsers.mistral import MistralToolParser
from octavo.serving.tool_parsers.pythonic import PythonicToolParser
from octavo.serving.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from octavo.serving.tool_parsers.tagged import (DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                                KimiK2ToolParser)

TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType({
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                              PythonicToolParser, KimiK2ToolParser, DeepSeekV3ToolParser,
                              DeepSeekV31ToolParser, Qwen3CoderToolParser, Glm45ToolParser,
                              HarmonyToolParser)
})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; "
                         f"choose one of {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ContentDelta", "ParsedToolCalls", "StreamEvent", "ToolCall",
           "ToolCallDelta", "ToolParser", "get_tool_parser", "tool_call_id"]
