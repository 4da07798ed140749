"""Tool-call parsers on model-style outputs, well-formed and not: the whole-output parse, and the
stream fed in every split (each split point, one character at a time, random splits) giving the
same content and calls."""
from __future__ import annotations

import json
import keyword
import re
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from octavo.serving.tool_choice import FunctionSpec
from octavo.serving.tool_parsers import (TOOL_PARSERS, ContentDelta, ToolCallDelta, ToolParser,
                                         get_tool_parser)


@dataclass
class Case:
    text: str
    content: str
    calls: list[tuple[str, dict]]
    # The call was announced while streaming and broke afterwards: the stream keeps the call
    # with the arguments sent so far and sends the rest as content, while the whole-output parse
    # makes all its text content (base.py explains why). (streamed content, streamed arguments)
    broken_stream: tuple[str, str] | None = None


W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
CASES: dict[str, list[Case]] = {
    "hermes": [
        Case("The capital of France is Paris.", "The capital of France is Paris.", []),
        Case(f"<tool_call>\n{W}\n</tool_call>", "",
             [("get_weather", {"city": "Paris", "days": [1, 2]})]),
        Case(f'Let me check.\n\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n',
             "Let me check.",
             [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"zone": "CET"})]),
        Case('<tool_call>{"arguments": {"a": "<tool_call>}"}, "name": "f"}</tool_call> done',
             "done", [("f", {"a": "<tool_call>}"})]),
        Case('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
             [("f", {"a": 1})]),
        Case('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
        Case('<tool_call>{"name": "f", "arguments": null}</tool_call>', "", [("f", {})]),
        Case('<tool_call>{"type": "function", "name": "f", "arguments": {}, "id": 3}</tool_call>',
             "", [("f", {})]),
        # A missing final brace or closing tag is forgiven once name and arguments are complete.
        Case('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "", [("f", {"a": 1})]),
        Case('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),
        Case('<tool_call>{"name": "f", "arguments": {"a": 1}}}</tool_call>', "}</tool_call>",
             [("f", {"a": 1})]),
        Case('Use <tool_call> tags. <tool_call', "Use <tool_call> tags. <tool_call", []),
        Case('x <tool_call>{"name": 3, "arguments": {}}</tool_call>',
             'x <tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
        Case("<tool_call>{'name': 'f'}</tool_call>", "<tool_call>{'name': 'f'}</tool_call>", []),
        Case('<tool_call>{"foo": 1, "name": "f"}</tool_call>',
             '<tool_call>{"foo": 1, "name": "f"}</tool_call>', []),
        Case('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
             '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
        Case('<tool_call>{"name": "f", "arguments": {"a": 1', '<tool_call>{"name": "f", '
             '"arguments": {"a": 1', [], broken_stream=("", '{"a": 1')),
        Case('a\n<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>b',
             'a\n<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>b', [],
             broken_stream=("a}}</tool_call>b", '{"a": tru')),
    ],
    "llama3_json": [
        Case('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
             [("get_weather", {"city": "Paris"})]),
        Case('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
             "", [("f", {"x": 1}), ("g", {})]),
        Case(' {"type": "function", "name": "f", "parameters": {}}\n'
             '{"name": "g", "parameters": {}}', "", [("f", {}), ("g", {})]),
        Case('The result is {"name": "f", "parameters": {}}',
             'The result is {"name": "f", "parameters": {}}', []),
        Case('{"city": "Paris", "temp": 21}', '{"city": "Paris", "temp": 21}', []),
        Case('{"name": "f", "parameters": {}}; then text', "; then text", [("f", {})]),
        Case('<|python_tag|>print(1)', "<|python_tag|>print(1)", []),
        Case('<|python_ta', "<|python_ta", []),
        Case("{broken", "{broken", []),
    ],
    "mistral": [
        Case('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "f", "arguments": {}}]', "",
             [("get_weather", {"city": "Paris"}), ("f", {})]),
        Case('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}',
             "Checking.", [("get_weather", {"city": "Paris"}), ("f", {})]),
        Case('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": [1]}', "", [("f", {"x": [1]})]),
        Case('[TOOL_CALLS]f{"x": 1}', "", [("f", {"x": 1})]),
        Case(' [{"name": "f", "arguments": {"x": 1}}]', "", [("f", {"x": 1})]),
        Case('[1, 2, 3] are numbers', "[1, 2, 3] are numbers", []),
        Case('[{"id": 1, "label": "a"}]', '[{"id": 1, "label": "a"}]', []),
        Case('[TOOL_CALLS] []', "[TOOL_CALLS] []", []),
        Case('[TOOL_CALLS] {"name": "f", "arguments": {}} ok', "ok", [("f", {})]),
        Case('[TOOL_CALLS]{', "[TOOL_CALLS]{", []),
        Case('[TOOL_CALLS] [{"name": "f", "arguments": {}}, 7]', ", 7]", [("f", {})]),
        Case('[TOOL_CALLS]f[ARGS]', "[TOOL_CALLS]f[ARGS]", []),
        Case('[TOOL_CALLS]f g', "[TOOL_CALLS]f g", []),
        Case('[TOOL_CALLS]f[ARGS]{"x": }', '[TOOL_CALLS]f[ARGS]{"x": }', [],
             broken_stream=("}", '{"x": ')),
    ],
    "pythonic": [
        Case('[get_weather(city="Paris", units=\'metric\'), get_time()]', "",
             [("get_weather", {"city": "Paris", "units": "metric"}), ("get_time", {})]),
        Case('<|python_start|>[f(a=[1, (2, 3)], b={"k": None}, c=-1.5, d=True, e=null)]'
             '<|python_end|>', "",
             [("f", {"a": [1, [2, 3]], "b": {"k": None}, "c": -1.5, "d": True, "e": None})]),
        Case('[f(s="a)b]c", t=\'\'\'x"y\'z\'\'\', u="\\"")] And more.', "And more.",
             [("f", {"s": "a)b]c", "t": 'x"y\'z', "u": '"'})]),
        Case('[math.sqrt(x=2)]', "", [("math.sqrt", {"x": 2})]),
        Case("[Note] this is text", "[Note] this is text", []),
        Case("[1, 2]", "[1, 2]", []),
        Case("[f(1)]", "[f(1)]", []),
        Case('[f(x=__import__("os").system("true"))]',
             '[f(x=__import__("os").system("true"))]', []),
        Case("[f(x=1, x=2)]", "[f(x=1, x=2)]", []),
        Case("[f(**kw)]", "[f(**kw)]", []),
        Case("[f(x={1, 2})]", "[f(x={1, 2})]", []),
        Case("[f(x=1), g(y=", ", g(y=", [("f", {"x": 1})]),
        Case("Here: [f(x=1)]", "Here: [f(x=1)]", []),
    ],
}
K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
D_SEC, D_SEC_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
D_CALL, D_SEP, D_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
CASES.update({
    "kimi_k2": [
        Case(f'Checking.{K_SEC}{K_CALL}functions.get_weather:0{K_ARGS}{{"city": "Paris"}}{K_END}'
             f'{K_CALL}functions.f:1 {K_ARGS} {{}}{K_END}{K_SEC_END}', "Checking.",
             [("get_weather", {"city": "Paris"}), ("f", {})]),
        Case(f'{K_CALL}functions.f:0{K_ARGS}{{"x": [1]}}{K_END} then text', "then text",
             [("f", {"x": [1]})]),
        Case(f'{K_SEC} no call', f'{K_SEC} no call', []),
        Case(f'{K_SEC}{K_CALL}get weather:0{K_ARGS}{{}}',
             f'{K_SEC}{K_CALL}get weather:0{K_ARGS}{{}}', []),
        Case(f'{K_CALL}functions.f{K_ARGS}{{}}{K_END}', f'{K_CALL}functions.f{K_ARGS}{{}}{K_END}',
             []),
        Case(f'{K_CALL}functions.f:0{K_ARGS}{{"x": }}{K_END}',
             f'{K_CALL}functions.f:0{K_ARGS}{{"x": }}{K_END}', [],
             broken_stream=(f"}}{K_END}", '{"x": ')),
        Case("<|tool_call", "<|tool_call", []),
    ],
    "deepseek_v3": [
        Case(f'Let me look.{D_SEC}{D_CALL}function{D_SEP}get_weather\n```json\n'
             f'{{"city": "Paris"}}\n```{D_END}\n{D_CALL}function{D_SEP}f\n```json\n{{}}\n```'
             f'{D_END}{D_SEC_END}', "Let me look.",
             [("get_weather", {"city": "Paris"}), ("f", {})]),
        Case(f'{D_CALL}function{D_SEP}f\n```json\n{{"a": "```"}}\n```{D_END}', "",
             [("f", {"a": "```"})]),
        Case(f'{D_CALL}function{D_SEP}f\n{{"a": 1}}', f'{D_CALL}function{D_SEP}f\n{{"a": 1}}', []),
        Case(f'{D_CALL}tool{D_SEP}f', f'{D_CALL}tool{D_SEP}f', []),
    ],
    "deepseek_v31": [
        Case(f'{D_SEC}{D_CALL}get_weather{D_SEP}{{"city": "Paris"}}{D_END}{D_CALL}f{D_SEP}{{}}'
             f'{D_END}{D_SEC_END} done', "done", [("get_weather", {"city": "Paris"}), ("f", {})]),
        Case(f'{D_CALL}f{D_SEP}[1]{D_END}', f'{D_CALL}f{D_SEP}[1]{D_END}', []),
        Case(f'A {D_SEC}', f'A {D_SEC}', []),
    ],
})
Q_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
          "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
CASES["qwen3_coder"] = [  # without the request's schemas, every value stays text
    Case(f"Let me check.\n{Q_CALL}\n{Q_CALL}", "Let me check.",
         [("get_weather", {"city": "Paris", "days": "[1, 2]"})] * 2),
    Case("<tool_call><function=f></function></tool_call> done", "done", [("f", {})]),
    Case("<tool_call>\n<function=f>\n<parameter=code>\nif a < b:\n    x = '</p'\n</parameter>"
         "\n</function>", "", [("f", {"code": "if a < b:\n    x = '</p'"})]),
    Case("<tool_call>\n<function=f>\n<parameter=x>1</parameter>\n</tool_call>",
         "<tool_call>\n<function=f>\n<parameter=x>1</parameter>\n</tool_call>", [],
         broken_stream=("</tool_call>", '{"x": "1"')),
    Case("<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>",
         []),
    Case("<tool_call>\n<function=f g>", "<tool_call>\n<function=f g>", []),
    Case("Use <function=f> tags", "Use <function=f> tags", []),
]
G_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
          "<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>")
CASES["glm45"] = [  # without the request's schemas, a value that spells a literal is one
    Case(f"Let me check.\n{G_CALL}\n{G_CALL}", "Let me check.",
         [("get_weather", {"city": "Paris", "days": [1, 2]})] * 2),
    Case("<tool_call>f\n</tool_call> done", "done", [("f", {})]),
    Case("<tool_call>f<arg_key>x</arg_key><arg_value>a < b</arg_value></tool_call>", "",
         [("f", {"x": "a < b"})]),  # GLM-4.7: no newline after the name
    Case("<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>if a:\n  x = '</arg'"
         "</arg_value>\n</tool_call>", "", [("f", {"code": "if a:\n  x = '</arg'"})]),
    Case("<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</function>",
         "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</function>", [],
         broken_stream=("</function>", '{"x": 1')),
    # the closing tag missing at the end of the output is forgiven, a value cut off is not
    Case("<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n", "",
         [("f", {"x": 1})]),
    Case("<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1", "<tool_call>f\n<arg_key>x"
         "</arg_key>\n<arg_value>1", [], broken_stream=("", "{")),
    Case('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    Case("<tool_call>get weather\n</tool_call>", "<tool_call>get weather\n</tool_call>", []),
    Case("Use <arg_key> tags", "Use <arg_key> tags", []),
]
H_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
          '<|message|>{"city": "Paris", "days": [1, 2]}<|call|>')
CASES["openai"] = [  # what the openai_gptoss reasoning parser leaves: content and whole calls
    Case("It is 4.", "It is 4.", []),
    Case(f"Let me check.{H_CALL}{H_CALL}", "Let me check.",
         [("get_weather", {"city": "Paris", "days": [1, 2]})] * 2),
    Case('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}', "",
         [("f", {})]),  # the recipient before the channel; the end tag a stop token, cut
    Case('<|channel|>commentary to=functions.f<|message|>{"a": 1}<|end|> done', "done",
         [("f", {"a": 1})]),
    Case('<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>',
         '<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>', []),
    Case('<|channel|>final<|message|>hi', '<|channel|>final<|message|>hi', []),
    Case('<|channel|>commentary to=functions.f<|message|>not json',
         '<|channel|>commentary to=functions.f<|message|>not json', []),
    Case('<|channel|>commentary to=functions.f<|message|>{"a": }<|call|>',
         '<|channel|>commentary to=functions.f<|message|>{"a": }<|call|>', [],
         broken_stream=("}<|call|>", '{"a": ')),
    Case("<|start|>x <|channel", "<|start|>x <|channel", []),
]
ALL = [(name, c) for name, cases in CASES.items() for c in cases]
IDS = [f"{name}-{i}" for name, cases in CASES.items() for i in range(len(cases))]


def collect(events: list) -> tuple[str, list[dict]]:
    """Content and calls from stream events, checking the delta shape as it goes."""
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
            continue
        assert isinstance(e, ToolCallDelta)
        if e.index == len(calls):
            assert e.id and e.name, "a call's first delta carries its id and name"
            calls.append({"id": e.id, "name": e.name, "arguments": e.arguments})
        else:
            assert e.index == len(calls) - 1 and e.id is None and e.name is None
            calls[-1]["arguments"] += e.arguments
    return content, calls


def stream(cls: type[ToolParser], pieces: list[str], **options) -> tuple[str, list[dict]]:
    parser = cls(**options)
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    return collect(events)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def shape(content: str, calls: list[dict]) -> tuple[str, list]:
    return content, [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("name, case", ALL, ids=IDS)
def test_whole_output_parse(name, case):
    parsed = get_tool_parser(name).parse(case.text)
    assert parsed.content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == case.calls
    for c in parsed.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("name, case", ALL, ids=IDS)
def test_every_split_streams_the_same(name, case):
    cls = get_tool_parser(name)
    whole = stream(cls, [case.text])
    text = case.text
    for i in range(len(text) + 1):
        assert shape(*stream(cls, split_at(text, [i]))) == shape(*whole), f"split at {i}"
    assert shape(*stream(cls, list(text))) == shape(*whole), "one character at a time"
    parsed = cls.parse(text)
    if case.broken_stream is None:
        assert whole[0] == parsed.content
        assert [(c["name"], c["arguments"]) for c in whole[1]] == \
               [(c.name, c.arguments) for c in parsed.tool_calls]
    else:
        assert (whole[0], whole[1][-1]["arguments"]) == case.broken_stream


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALL), st.data())
def test_random_splits_stream_the_same(named_case, data):
    name, case = named_case
    cls = get_tool_parser(name)
    n = len(case.text)
    cuts = data.draw(st.lists(st.integers(0, n), max_size=min(n, 12)))
    assert shape(*stream(cls, split_at(case.text, cuts))) == shape(*stream(cls, [case.text]))


# ---- generated outputs: random content around random calls ----

# Python keywords cannot be function or argument names in the pythonic format.
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n))
arg_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6)
arguments = st.dictionaries(names, arg_values, max_size=4)
# Text with the characters tags are made of, so partial tags show up in the content.
prose = st.text(alphabet="ab <>/[]{}_|tol:;,\n", max_size=20)


def render(name: str, calls: list[tuple[str, dict]]) -> str:
    if name == "hermes":
        return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                       for n, a in calls)
    if name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if name == "mistral":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if name == "qwen3_coder":
        return "".join(
            f"<tool_call>\n<function={n}>\n" + "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in a.items()) + "</function>\n</tool_call>\n" for n, a in calls)
    if name == "openai":
        return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>"
                       f"json<|message|>{json.dumps(a)}<|call|>" for n, a in calls)
    if name == "glm45":
        return "".join(
            f"<tool_call>{n}\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                "</arg_value>\n" for k, v in a.items()) + "</tool_call>\n" for n, a in calls)
    if name == "kimi_k2":
        return K_SEC + "".join(f"{K_CALL}functions.{n}:{i}{K_ARGS}{json.dumps(a)}{K_END}"
                               for i, (n, a) in enumerate(calls)) + K_SEC_END
    if name == "deepseek_v3":
        return D_SEC + "".join(f"{D_CALL}function{D_SEP}{n}\n```json\n{json.dumps(a)}\n```"
                               f"{D_END}\n" for n, a in calls) + D_SEC_END
    if name == "deepseek_v31":
        return D_SEC + "".join(f"{D_CALL}{n}{D_SEP}{json.dumps(a)}{D_END}"
                               for n, a in calls) + D_SEC_END
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})"
                           for n, a in calls) + "]"


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(sorted(TOOL_PARSERS)), prose, st.lists(st.tuples(names, arguments),
                                                             min_size=1, max_size=3), st.data())
def test_generated_calls_round_trip(name, before, calls, data):
    if name in ("llama3_json", "pythonic"):
        before = ""  # these formats have calls only at the start of the output
    if any(tag in before for tag in ("<tool_call>", "[TOOL_CALLS]", "<|tool_call", "<|start|>",
                                     "<|channel|>")):
        before = before.replace("<", "(").replace("[", "(")
    text = before + render(name, calls)
    cls = get_tool_parser(name)
    options = {}
    if name in ("qwen3_coder", "glm45"):  # values typed by the schemas
        if name == "qwen3_coder":  # a value's edge newline is markup
            assume(not any(isinstance(v, str) and (v[:1] == "\n" or v[-1:] == "\n")
                           for _, a in calls for v in a.values()))
        else:  # a value holds no closing tag
            assume(not any(isinstance(v, str) and "</arg_value>" in v
                           for _, a in calls for v in a.values()))
        properties: dict[str, dict] = {}  # one schema per function, as a request has
        for n, a in calls:
            for k, v in a.items():
                kinds = properties.setdefault(n, {})
                assume(kinds.setdefault(k, _json_type(v)) == _json_type(v))
        options = {"functions": [FunctionSpec(n, {"type": "object", "properties": {
            k: {"type": t} for k, t in kinds.items()}}) for n, kinds in properties.items()]}
    parsed = cls.parse(text, **options)
    if name == "mistral" and before.lstrip().startswith("[") and "{" in before:
        return  # may legitimately read as the bare-array format
    assert parsed.content == before.rstrip() if before.strip() else parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    streamed = stream(cls, split_at(text, cuts), **options)
    assert streamed[0] == parsed.content
    assert [(c["name"], c["arguments"]) for c in streamed[1]] == \
           [(c.name, c.arguments) for c in parsed.tool_calls]


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(value)]


FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", K_SEC, K_CALL,
             K_ARGS, K_END, K_SEC_END, "functions.f:0", D_SEC, D_CALL, D_SEP, D_END, D_SEC_END,
             "function", "```json", "```", "<|tool_", "<｜tool▁", "<function=f>", "</function>",
             "<parameter=x>", "</parameter>", "<function=", "<parameter", "<arg_key>",
             "</arg_key>", "<arg_value>", "</arg_value>", "<arg_", "</arg", "<|start|>",
             "<|channel|>", "<|message|>", "<|call|>", "<|end|>", "assistant", " to=functions.f",
             "commentary", "<|constrain|>json", "<|chan",
             "<|python_tag|>", "<|python_start|>", "<|python_end|>", "{", "}", "[", "]", "(", ")",
             '"name"', '"arguments"', '"parameters"', '"type"', ": ", ", ", ";", '"f"', "f", "x=",
             "1", "null", '"a\\"b"', "'q'", '"""', "\n", " ", "text", "<", "<tool", "[TOOL"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(TOOL_PARSERS)), st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       st.data())
def test_near_miss_outputs_never_raise_lose_text_or_depend_on_the_split(name, fragments, data):
    text = "".join(fragments)
    cls = get_tool_parser(name)
    parsed = cls.parse(text)
    whole = stream(cls, [text])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert shape(*stream(cls, split_at(text, cuts))) == shape(*whole)
    if not parsed.tool_calls:
        assert parsed.content == text  # text that holds no call comes back as it was
    for c in parsed.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


# ---- ids, registry, misuse ----

def test_ids_are_openai_style_by_default_and_the_api_layer_may_choose():
    text = f"<tool_call>{W}</tool_call><tool_call>{W}</tool_call>"
    ids = [c.id for c in get_tool_parser("hermes").parse(text).tool_calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and ids[0] != ids[1]
    counter = iter(range(100))
    custom = get_tool_parser("hermes").parse(text, new_id=lambda: f"toolu_{next(counter)}")
    assert [c.id for c in custom.tool_calls] == ["toolu_0", "toolu_1"]
    mistral = get_tool_parser("mistral").parse('[TOOL_CALLS]f[ARGS]{}').tool_calls[0].id
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral)


def test_streamed_id_is_sent_once_and_matches_the_announced_call():
    parser = get_tool_parser("hermes")(new_id=lambda: "call_x")
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert first == [ToolCallDelta(0, "call_x", "f", '{"a"')]
    assert parser.has_tool_calls
    assert parser.feed(': 1}}</tool_call>') == [ToolCallDelta(0, arguments=": 1}")]
    assert parser.finish() == []


def test_a_possible_tag_is_held_back_until_decided():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]
    assert parser.feed("box>") == [ContentDelta(" <toolbox>")]
    parser = get_tool_parser("mistral")()
    assert parser.feed("ok [TOOL_") == [ContentDelta("ok")]
    assert parser.feed("CALLS]f[ARGS]{") == [ToolCallDelta(0, parser._call.id, "f", "{")]


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'nope'; choose one of "
                                         "deepseek_v3, deepseek_v31, glm45, hermes, kimi_k2, "
                                         "llama3_json, mistral, openai, pythonic, "
                                         "qwen3_coder"):
        get_tool_parser("nope")


def test_feed_after_finish_is_an_error():
    parser = get_tool_parser("hermes")()
    parser.finish()
    with pytest.raises(ValueError, match="after finish"):
        parser.feed("x")


def test_formats_of_special_tokens_need_them_kept():
    assert {n for n, cls in TOOL_PARSERS.items() if not cls.skip_special_tokens} == {
        "mistral", "kimi_k2", "deepseek_v3", "deepseek_v31", "openai"}
