"""Tool calling and reasoning output through the servers, with the official `openai` and
`anthropic` clients: tool_choice required / named (OpenAI) and any / tool (Anthropic) return
arguments valid against each function's schema, streamed and not; auto with a model that does not
call tools returns its text; tool calls and results in the conversation render through the chat
template; bad tools and choices are 400s naming the field. SmolLM2 never writes `<think>` or
`<tool_call>`, so the response shapes of reasoning and of the model's own calls are checked on
canned text with the functions the endpoints use."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from octavo.engine.tokenizer import Tokenizer
from octavo.entrypoints.anthropic.tools import BlockStream, content_blocks, template_messages
from octavo.entrypoints.cli.main import main
from octavo.entrypoints.openai.tools import delta_of, message_of, template_message
from octavo.serving.chat_output import ChatParsers, ToolRequest, plan_chat_output
from octavo.serving.chat_template import render_chat_text
from octavo.serving.tool_choice import FunctionSpec
from tests.e2e.conftest import SERVED_NAME, start_server

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n} tool",
                                                  "parameters": s}} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"The {n} tool", "input_schema": s}
                   for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tool parts of Qwen 2.5's template (hermes style), to see what the conversation renders to.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n"
    "</tool_response>\n{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_server(smollm_gguf, tmp_path_factory):
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("tools"), "--tool-call-parser",
                       "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
                       "--trust-request-chat-template")  # a test renders through HERMES_TEMPLATE
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(tool_server):
    return anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)


def check_call(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


def streamed_calls(chunks) -> tuple[dict[int, list], str | None, str]:
    """index -> [id, name, arguments text] from OpenAI stream chunks; the finish reason; content."""
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("choice, parallel", [
    ("required", None), ("required", False),
    ({"type": "function", "function": {"name": "add"}}, None)])
def test_openai_forced_calls_validate_streamed_and_not(oai, choice, parallel):
    kw = dict(model=SERVED_NAME, messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice,
              max_tokens=64, temperature=0)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls and (parallel is None or len(msg.tool_calls) == 1)
    for call in msg.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["add"]
    calls, finish, content = streamed_calls(oai.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(name, args) for _, name, args in calls.values()] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_validates_streamed_and_not(claude, choice):
    kw = dict(model=SERVED_NAME, max_tokens=48, messages=ASK, tools=ANTHROPIC_TOOLS,
              tool_choice=choice, extra_body={"temperature": 0})
    full = claude.messages.create(**kw)
    uses = [b for b in full.content if b.type == "tool_use"]
    assert full.stop_reason == "tool_use" and uses
    for block in uses:
        assert block.id.startswith("toolu_")
        check_call(block.name, block.input)
    if choice["type"] == "tool":
        assert [b.name for b in uses] == ["get_weather"]
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in uses]


def test_auto_without_a_call_returns_the_text(oai, claude):
    kw = dict(model=SERVED_NAME, messages=ASK, max_tokens=16, temperature=0)
    plain = oai.chat.completions.create(**kw)
    auto = oai.chat.completions.create(**kw, tools=OPENAI_TOOLS)  # auto is the default
    msg = auto.choices[0].message
    # SmolLM2's template ignores tools: the same prompt, the same text, now read for calls.
    assert msg.content == plain.choices[0].message.content and msg.content
    assert not msg.tool_calls and auto.choices[0].finish_reason == plain.choices[0].finish_reason
    assert msg.model_extra["reasoning_content"] is None  # qwen3: no <think>, no reasoning
    calls, finish, content = streamed_calls(oai.chat.completions.create(
        **kw, tools=OPENAI_TOOLS, tool_choice="auto", stream=True))
    assert calls == {} and content == msg.content and finish == auto.choices[0].finish_reason
    none = oai.chat.completions.create(**kw, tools=OPENAI_TOOLS, tool_choice="none")
    assert none.choices[0].message.content == msg.content
    reply = claude.messages.create(model=SERVED_NAME, max_tokens=16, messages=ASK,
                                   tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == msg.content


def test_tool_calls_and_results_render_through_the_template(oai, claude, tool_server):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    conv = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = httpx.post(tool_server.url + "/tokenize", timeout=60, json={
        "messages": conv, "tools": OPENAI_TOOLS, "chat_template": HERMES_TEMPLATE})
    assert r.status_code == 200, r.text
    text = httpx.post(tool_server.url + "/detokenize", json={"tokens": r.json()["tokens"]},
                      timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '"name": "add"' in text.split("</tools>")[0]
    reply = oai.chat.completions.create(model=SERVED_NAME, messages=conv, tools=OPENAI_TOOLS,
                                        max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    anthropic_conv = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "call_1", "name": "get_weather",
         "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    count = claude.messages.count_tokens(model=SERVED_NAME, messages=anthropic_conv,
                                         tools=ANTHROPIC_TOOLS)
    same = httpx.post(tool_server.url + "/tokenize", timeout=60,
                      json={"messages": conv, "tools": OPENAI_TOOLS})
    assert count.input_tokens == same.json()["count"]  # the same conversation for the template
    msg = claude.messages.create(model=SERVED_NAME, max_tokens=8, messages=anthropic_conv,
                                 tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    assert msg.stop_reason in ("end_turn", "max_tokens")


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param, fragment", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name",
     "letters, digits"),
    ({"tools": [FN, FN]}, "tools", "'f' repeats"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "tools[0].function.parameters is not a usable JSON "
                                           "schema"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "'g', which is not among the tools (f)"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [FN], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
])
def test_bad_openai_tools_are_400s_naming_the_field(tool_server, body, param, fragment):
    r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


@pytest.mark.parametrize("body, fragment", [
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema' is required"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
     "tool_choice.name is required"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool",
                                                                     "name": "g"}},
     "'g', which is not among the tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0: a tool_result block needs a string 'tool_use_id'"),
])
def test_bad_anthropic_tools_are_400s(tool_server, body, fragment):
    r = httpx.post(tool_server.url + "/v1/messages", timeout=60,
                   json={"model": SERVED_NAME, "max_tokens": 2, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and fragment in err["error"]["message"], err


@pytest.mark.parametrize("flags, fragment", [
    (["--tool-call-parser", "nope"], "choose one of deepseek_v3, deepseek_v31, glm45, hermes, "
                                     "kimi_k2, llama3_json, mistral, openai, pythonic, "
                                     "qwen3_coder"),
    (["--reasoning-parser", "r2"], "choose one of deepseek_r1, glm45, openai_gptoss, qwen3"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_bad_parser_flags_fail_at_start_up(capsys, flags, fragment):
    assert main(["serve", "/nope.gguf", *flags]) == 2  # refused before the model is looked at
    assert fragment in capsys.readouterr().err


# -- response shapes on canned model text ------------------------------------------------------

CANNED = ('<think>\nWeather needs a tool.\n</think>\n\nChecking.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
          '</tool_call>')
PARSERS = ChatParsers.from_flags("hermes", True, "qwen3")
TOOLS = ToolRequest("auto", (FunctionSpec("get_weather", WEATHER),))


def canned_plan():
    return plan_chat_output(PARSERS, TOOLS, None, [1], lambda: "call_x")


def test_openai_shapes_of_reasoning_and_calls():
    plan = canned_plan()
    assert message_of(plan.parse(CANNED), plan.reads_reasoning) == {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Weather needs a tool.",
        "tool_calls": [{"id": "call_x", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]}
    reader = plan.stream()
    deltas = [delta_of(reader.feed(ch)) for ch in CANNED] + [delta_of(reader.finish())]
    deltas = [d for d in deltas if d]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needs a tool."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    first = calls[0]
    assert (first["index"], first["id"], first["type"], first["function"]["name"]) == (
        0, "call_x", "function", "get_weather")
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == \
        '{"city": "Oslo", "unit": "celsius"}'
    assert reader.has_tool_calls
    plain = message_of(canned_plan().parse("Just words."), True)
    assert plain == {"role": "assistant", "content": "Just words.", "reasoning_content": None}


def test_anthropic_shapes_of_thinking_and_tool_use():
    plan = canned_plan()
    assert content_blocks(plan.parse(CANNED)) == [
        {"type": "thinking", "thinking": "Weather needs a tool.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_x", "name": "get_weather",
         "input": {"city": "Oslo", "unit": "celsius"}}]
    reader, blocks = plan.stream(), BlockStream()
    events = [e for ch in CANNED for e in blocks.events(reader.feed(ch))]
    events += [*blocks.events(reader.finish()), *blocks.finish()]
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    partial = "".join(e["delta"].get("partial_json", "") for e in events
                      if e["type"] == "content_block_delta" and e["index"] == 2)
    assert json.loads(partial) == {"city": "Oslo", "unit": "celsius"}
    empty = BlockStream()
    assert [e["type"] for e in empty.finish()] == ["content_block_start", "content_block_stop"]


def test_conversations_become_template_messages(smollm_oracle_folder):
    openai_side = [template_message(m) for m in [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"x": 1}'}}, {"id": "c2", "type": "function",
         "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]]
    assert openai_side[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert openai_side[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    anthropic_side = template_messages(1, "assistant", [
        {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": ""},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}},
        {"type": "tool_use", "id": "c2", "name": "g", "input": {}}])
    assert anthropic_side == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]}]
    results = template_messages(2, "user", [
        {"type": "tool_result", "tool_use_id": "c1", "content": "2"},
        {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "ok"}],
         "is_error": False},
        {"type": "text", "text": "Thanks."}])
    assert results == [{"role": "tool", "tool_call_id": "c1", "content": "2"},
                       {"role": "tool", "tool_call_id": "c2", "content": "ok"},
                       {"role": "user", "content": "Thanks."}]
    tok = Tokenizer.from_folder(smollm_oracle_folder)
    text = render_chat_text(tok, [*ASK, *openai_side, *anthropic_side, *results],
                            HERMES_TEMPLATE)
    assert text.count('"arguments": {"x": 1}}') == 2 and '"arguments": "not json"}' in text
    assert "<tool_response>\nok\n</tool_response>\n<|im_start|>user\nThanks." in text
