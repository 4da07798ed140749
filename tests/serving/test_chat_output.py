"""Planning a chat request's output (tool_choice modes, the reasoning gate on grammars, flags) and
reading it: reasoning, content and tool calls from canned model text, streamed at every split
point and whole."""
from __future__ import annotations

import json

import pytest

from octavo.params import ReasoningEndRule, StructuredOutputsParams
from octavo.serving.chat_output import (ChatParsers, ReasoningText, ToolRequest,
                                        plan_chat_output)
from octavo.serving.tool_choice import FunctionSpec, required_tools_schema
from octavo.serving.tool_parsers import ContentDelta, ToolCallDelta

WEATHER = FunctionSpec("get_weather", {"type": "object",
                                       "properties": {"city": {"type": "string"}},
                                       "required": ["city"]})
NOW = FunctionSpec("now")
VOCAB = {"<think>": 7, "</think>": 8}
RULE = ReasoningEndRule(7, 8, start_required=False)
AUTO = ChatParsers.from_flags("hermes", True, None)
ALL = ChatParsers.from_flags("hermes", True, "deepseek_r1").for_vocab(VOCAB)


def plan(parsers, mode="auto", structured=None, prompt=(1, 2), functions=(WEATHER, NOW),
         name=None, parallel=True):
    tools = None if mode is None else ToolRequest(mode, functions, name, parallel)
    return plan_chat_output(parsers, tools, structured, list(prompt), lambda: "call_1")


def stream(p, pieces):
    """Feed the pieces; returns (reasoning, content, {index: [name, arguments]}, tool flag)."""
    reader = p.stream()
    events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningText))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index not in calls and e.id == "call_1"
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return reasoning, content, calls, reader.has_tool_calls


def test_flags_are_checked_by_name():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'herms'; choose one "
                                         "of deepseek_v3, deepseek_v31, glm45, hermes, kimi_k2, "
                                         "llama3_json, mistral, openai, pythonic, qwen3_coder"):
        ChatParsers.from_flags("herms", True, None)
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'r1'; choose one of "
                                         "deepseek_r1, glm45, openai_gptoss, qwen3"):
        ChatParsers.from_flags(None, False, "r1")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatParsers.from_flags(None, True, None)
    assert ALL.reasoning_end == RULE
    assert ChatParsers.from_flags(None, False, "qwen3").for_vocab({}).reasoning_end is None


@pytest.mark.parametrize("parsers, missing", [
    (ChatParsers(), "--enable-auto-tool-choice and --tool-call-parser"),
    (ChatParsers.from_flags("hermes", False, None), "--enable-auto-tool-choice;"),
])
def test_auto_needs_the_flags(parsers, missing):
    with pytest.raises(ValueError, match=missing):
        plan(parsers)


def test_tool_choice_problems_name_the_field():
    with pytest.raises(ValueError, match="tool_choice 'required' needs tools"):
        plan(AUTO, "required", functions=())
    with pytest.raises(ValueError, match="names the function 'nope', which is not among the "
                                         "tools \\(get_weather, now\\)"):
        plan(AUTO, "named", name="nope")
    with pytest.raises(ValueError, match="cannot be combined with a structured output"):
        plan(AUTO, "required", StructuredOutputsParams(json_object=True))


def test_required_and_named_are_grammars_read_by_their_parsers():
    required = plan(AUTO, "required", parallel=False)
    assert required.structured.json == required_tools_schema([WEATHER, NOW], parallel=False)
    assert required.structured.disable_any_whitespace
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    parsed = required.parse(text)
    assert parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in
                                     parsed.tool_calls] == [("get_weather", {"city": "Oslo"})]
    named = plan(AUTO, "named", name="get_weather")
    assert named.structured.json == WEATHER.parameters
    assert [c.name for c in named.parse('{"city":"Oslo"}').tool_calls] == ["get_weather"]
    for cut in range(len(text) + 1):
        _, content, calls, flagged = stream(required, [text[:cut], text[cut:]])
        assert content == "" and flagged
        assert calls == {0: ["get_weather", '{"city":"Oslo"}']}


def test_none_and_no_tools_leave_the_text_alone():
    for p in (plan(AUTO, "none"), plan(AUTO, None), plan(ChatParsers(), None)):
        assert p.plain and p.structured is None
        assert p.parse("<tool_call>x</tool_call>").content == "<tool_call>x</tool_call>"


OUTPUT = ('<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
          '{"name": "now", "arguments": {}}\n</tool_call>')


def test_reasoning_then_content_then_calls_at_every_split():
    p = plan(ALL)
    whole = p.parse(OUTPUT)
    assert whole.reasoning == "The user wants weather." and whole.content == "Let me look."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("now", "{}")]
    for cut in range(len(OUTPUT) + 1):
        got = stream(p, [OUTPUT[:cut], OUTPUT[cut:]])
        assert got == ("The user wants weather.", "Let me look.",
                       {0: ["get_weather", '{"city": "Oslo"}'], 1: ["now", "{}"]}, True), cut
    one = plan(ALL, parallel=False)
    assert [c.name for c in one.parse(OUTPUT).tool_calls] == ["get_weather"]
    assert stream(one, list(OUTPUT))[2] == {0: ["get_weather", '{"city": "Oslo"}']}


def test_malformed_calls_stay_content():
    p = plan(AUTO)
    text = 'Sure: <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> ok'
    parsed = p.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_grammars_wait_for_reasoning_where_the_core_can_tell():
    gated = plan(ALL, "required")
    assert gated.structured.reasoning_end == RULE and gated.reads_reasoning
    parsed = gated.parse('<think>hmm</think>[{"name":"now","arguments":{}}]')
    assert parsed.reasoning == "hmm" and [c.name for c in parsed.tool_calls] == ["now"]
    user = StructuredOutputsParams(json={"type": "object"})
    assert plan(ALL, None, user).structured.reasoning_end == RULE
    assert user.reasoning_end is None  # the caller's spec is not changed
    # Tags that are not single tokens: the grammar starts at once, so there is no reasoning.
    blind = ChatParsers.from_flags("hermes", True, "deepseek_r1").for_vocab({})
    p = plan(blind, "required")
    assert p.structured.reasoning_end is None and not p.reads_reasoning
    assert [c.name for c in p.parse('[{"name":"now","arguments":{}}]').tool_calls] == ["now"]
    # A prompt that already closed the reasoning section: nothing to split, nothing to gate.
    closed = plan(ALL, "required", prompt=(1, 7, 8, 3))
    assert closed.structured.reasoning_end is None and not closed.reads_reasoning
    assert plan(ALL, None, prompt=(1, 7, 8)).parse("Just this.").content == "Just this."


def test_mistral_keeps_special_tokens():
    p = plan(ChatParsers.from_flags("mistral", True, None))
    assert p.skip_special_tokens is False
    assert plan(AUTO).skip_special_tokens is None


@pytest.mark.parametrize("name, text", [
    ("qwen3_coder", "<tool_call>\n<function=count>\n<parameter=n>\n12\n</parameter>\n"
                    "<parameter=city>\n1999\n</parameter>\n<parameter=on>\nTrue\n</parameter>\n"
                    "</function>\n</tool_call>"),
    ("glm45", "<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>12</arg_value>\n"
              "<arg_key>city</arg_key>\n<arg_value>1999</arg_value>\n<arg_key>on</arg_key>\n"
              "<arg_value>True</arg_value>\n</tool_call>")])
def test_a_parser_that_types_values_gets_the_request_tools(name, text):
    """qwen3_coder and glm45 read parameter values as text and type them by the request's
    schemas: the plan hands them the tools, streamed and whole alike."""
    count = FunctionSpec("count", {"type": "object", "properties": {
        "n": {"type": "integer"}, "city": {"type": "string"}, "on": {"type": "boolean"}}})
    p = plan(ChatParsers.from_flags(name, True, None), functions=(count,))
    want = '{"n": 12, "city": "1999", "on": true}'
    assert p.parse(text).tool_calls[0].arguments == want
    assert stream(p, list(text))[2] == {0: ["count", want]}


def test_harmony_output_reads_into_reasoning_content_and_calls_streamed_or_whole():
    """gpt-oss's harmony messages with both parsers: the analysis channel is reasoning, a
    commentary message to functions.<name> a call, the final channel the answer; special tokens
    are kept for them."""
    p = plan(ChatParsers.from_flags("openai", True, "openai_gptoss"))
    assert p.skip_special_tokens is False
    assert plan(ChatParsers.from_flags(None, False, "openai_gptoss"), mode=None) \
        .skip_special_tokens is False
    text = ("<|channel|>analysis<|message|>Weather needed.<|end|><|start|>assistant<|channel|>"
            "commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    parsed = p.parse(text)
    assert (parsed.reasoning, parsed.content) == ("Weather needed.", "Checking.")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert stream(p, list(text)) == ("Weather needed.", "Checking.",
                                     {0: ["get_weather", '{"city": "Paris"}']}, True)
