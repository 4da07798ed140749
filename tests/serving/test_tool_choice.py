"""tool_choice required / named: the schemas built from the tools' parameter schemas accept exactly
the calls they should, and their parsers read those outputs whole and streamed."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.serving.tool_choice import (FunctionSpec, JsonArrayToolParser, NamedToolParser,
                                        named_tool_schema, required_tools_schema)
from tests.serving.test_tool_parsers import collect, split_at

WEATHER = FunctionSpec("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False})
NOW = FunctionSpec("now")  # no parameters schema: any object


def valid(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


@pytest.mark.parametrize("calls, ok", [
    ([{"name": "get_weather", "arguments": {"city": "Paris"}}], True),
    ([{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
      {"name": "now", "arguments": {"anything": [1]}}], True),
    ([], False),                                                       # at least one call
    ([{"name": "get_time", "arguments": {}}], False),                  # not a tool
    ([{"name": "get_weather", "arguments": {}}], False),               # city is required
    ([{"name": "get_weather", "arguments": {"city": "P", "days": 9}}], False),
    ([{"name": "now"}], False),                                        # arguments required
    ([{"name": "now", "arguments": {}, "extra": 1}], False),
    ({"name": "now", "arguments": {}}, False),                         # not an array
])
def test_required_schema(calls, ok):
    assert valid(required_tools_schema([WEATHER, NOW]), calls) == ok


def test_one_call_only_when_not_parallel():
    schema = required_tools_schema([NOW], parallel=False)
    assert valid(schema, [{"name": "now", "arguments": {}}])
    assert not valid(schema, [{"name": "now", "arguments": {}}] * 2)


def test_named_schema_is_the_arguments_schema():
    assert named_tool_schema(WEATHER) == dict(WEATHER.parameters)
    assert named_tool_schema(NOW) == {"type": "object"}


def test_bad_tool_lists_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="tools: tool_choice 'required' needs at least one tool"):
        required_tools_schema([])
    with pytest.raises(ValueError, match="tools: function names must be unique; 'now' repeats"):
        required_tools_schema([NOW, NOW])


def test_xgrammar_compiles_the_schemas():
    xgrammar = pytest.importorskip("xgrammar")
    for schema in (required_tools_schema([WEATHER, NOW]), required_tools_schema([NOW], False),
                   named_tool_schema(WEATHER)):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))


def stream(parser, text: str, cuts: list[int]):
    events = []
    for piece in split_at(text, cuts):
        events += parser.feed(piece)
    return collect(events + parser.finish())


calls_strategy = st.lists(st.tuples(st.sampled_from(["get_weather", "now"]),
                                    st.dictionaries(st.text(max_size=4), st.integers() | st.text(
                                        max_size=6), max_size=3)), min_size=1, max_size=3)


@settings(max_examples=100, deadline=None)
@given(calls_strategy, st.sampled_from([None, 2]), st.data())
def test_array_parser_reads_required_outputs(calls, indent, data):
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], indent=indent)
    parsed = JsonArrayToolParser.parse(text)
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    content, streamed = stream(JsonArrayToolParser(), text, cuts)
    assert content == "" and [(c["name"], c["arguments"]) for c in streamed] == \
        [(c.name, c.arguments) for c in parsed.tool_calls]


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=6), max_size=3),
       st.data())
def test_named_parser_reads_the_arguments_object(arguments, data):
    text = json.dumps(arguments)
    parsed = NamedToolParser.parse(text, function_name="get_weather")
    assert parsed.content == "" and len(parsed.tool_calls) == 1
    assert (parsed.tool_calls[0].name, parsed.tool_calls[0].arguments) == ("get_weather", text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    content, streamed = stream(NamedToolParser(function_name="get_weather"), text, cuts)
    assert content == "" and [(c["name"], c["arguments"]) for c in streamed] == \
        [("get_weather", text)]


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "[]", '[{"x": 1}]'])
def test_unconstrained_text_is_content_for_the_array_parser(text):
    parsed = JsonArrayToolParser.parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def test_named_parser_streams_from_the_first_brace():
    parser = NamedToolParser(lambda: "toolu_1", function_name="f")
    first = parser.feed(' {"a"')
    assert [(e.id, e.name, e.arguments) for e in first] == [("toolu_1", "f", '{"a"')]
    assert [e.arguments for e in parser.feed(": 1}")] == [": 1}"]
    assert parser.finish() == []
