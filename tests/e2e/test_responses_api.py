"""The Responses API (/v1/responses) on a real server, driven by the official `openai` client and
httpx: greedy output equal to the chat route's, the stream's events in order, stored responses,
previous_response_id, json_schema output, forced function calls, and 4xx bodies. The output-item
machine and the store are also checked on their own (canned reasoning and tool-call events, LRU
bounds)."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from octavo.entrypoints.openai.responses_output import OutputItems, reasoning_token_count
from octavo.entrypoints.openai.responses_protocol import input_messages
from octavo.entrypoints.openai.responses_store import ResponseStore
from octavo.params import ReasoningEndRule
from octavo.serving.chat_output import ReasoningText
from octavo.serving.tool_parsers import ContentDelta, ToolCallDelta
from tests.e2e.conftest import API_KEY, SERVED_NAME, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
ADD_TOOL = {"type": "function", "name": "add", "description": "Add two numbers",
            "parameters": ADD}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(server, body):
    return httpx.post(server.url + "/v1/responses", json={"model": SERVED_NAME, **body},
                      headers=AUTH, timeout=120)


def _token_count(server, messages) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, "messages": messages},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _collapsed(types: list[str]) -> list[str]:
    """Runs of one event type folded into one entry."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_greedy_text_and_usage_equal_the_chat_route(client):
    system = "You answer in one short sentence."
    resp = client.responses.create(model=SERVED_NAME, input=ASK, instructions=system,
                                   max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "system", "content": system}, *ASK],
        max_tokens=24, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    finish = chat.choices[0].finish_reason
    assert resp.status == ("completed" if finish == "stop" else "incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    assert resp.instructions == system and resp.max_output_tokens == 24
    assert resp.temperature == 0 and resp.store is True and resp.model == SERVED_NAME
    # a string input is one user message; input_text parts join to the same text
    plain = client.responses.create(model=SERVED_NAME, input=ASK[0]["content"],
                                    max_output_tokens=12, temperature=0)
    parts = client.responses.create(
        model=SERVED_NAME, max_output_tokens=12, temperature=0,
        input=[{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is the capital"},
            {"type": "input_text", "text": " of France?"}]}])
    assert plain.output_text == parts.output_text
    assert plain.usage.input_tokens == parts.usage.input_tokens


def test_stream_events_in_order_and_deltas_join_to_the_text(client, server):
    kw = dict(model=SERVED_NAME, input=ASK, max_output_tokens=30, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    final = events[-1]
    assert _collapsed(types[:-1]) == TEXT_EVENTS
    assert final.type == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == final.response.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert final.response.usage.model_dump() == whole.usage.model_dump()
    # the streamed response is stored as completed
    got = client.responses.retrieve(final.response.id)
    assert got.output_text == whole.output_text and got.status == whole.status


def test_stored_response_round_trip_and_delete(client, server):
    resp = client.responses.create(model=SERVED_NAME, input="Say hello.", max_output_tokens=8,
                                   temperature=0, metadata={"run": "7"})
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert got.usage.model_dump() == resp.usage.model_dump()
    assert got.metadata == {"run": "7"}
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    r = httpx.delete(f"{server.url}/v1/responses/{resp.id}", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_store_false_is_not_kept(client, server):
    resp = client.responses.create(model=SERVED_NAME, input="Say hello.", max_output_tokens=4,
                                   temperature=0, store=False)
    assert resp.store is False
    r = httpx.get(f"{server.url}/v1/responses/{resp.id}", headers=AUTH)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and resp.id in r.json()["error"]["message"]
    bad = _post(server, {"input": "Go on.", "previous_response_id": resp.id})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "previous_response_id"


def test_previous_response_id_continues_the_conversation(client, server):
    first_input = "My name is Ada. Remember it."
    first = client.responses.create(model=SERVED_NAME, input=first_input, max_output_tokens=16,
                                    temperature=0, instructions="Be brief.")
    second = client.responses.create(model=SERVED_NAME, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=16,
                                     temperature=0)
    assert second.previous_response_id == first.id
    # the earlier turn's input and output come first; its instructions do not carry over
    conversation = [{"role": "user", "content": first_input},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == _token_count(server, conversation)
    chat = client.chat.completions.create(model=SERVED_NAME, messages=conversation,
                                          max_tokens=16, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    # and a third turn holds both earlier ones
    third = client.responses.create(model=SERVED_NAME, input="Thanks.",
                                    previous_response_id=second.id, max_output_tokens=4,
                                    temperature=0)
    longer = conversation + [{"role": "assistant", "content": second.output_text},
                             {"role": "user", "content": "Thanks."}]
    assert third.usage.input_tokens == _token_count(server, longer)


def test_json_schema_format_output_parses(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    resp = client.responses.create(model=SERVED_NAME, input="Describe a person as JSON.",
                                   max_output_tokens=60, temperature=0, text={"format": fmt})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema"
    obj = client.responses.create(model=SERVED_NAME, input="A JSON object with the keys x and y:",
                                  max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_forced_function_call_streamed_and_not_then_its_result(client, server):
    kw = dict(model=SERVED_NAME, input="What is 2 plus 3?", tools=[ADD_TOOL],
              tool_choice="required", max_output_tokens=60, temperature=0)
    resp = client.responses.create(**kw)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed"
    for call in calls:
        assert call.name == "add" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), ADD)
    events = list(client.responses.create(**kw, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.arguments for e in done) == args == "".join(c.arguments for c in calls)
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "add"}})
    [call] = [item for item in named.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), ADD)
    # the call's result, after the stored turn: rendered through the template as a tool message
    follow = client.responses.create(
        model=SERVED_NAME, previous_response_id=resp.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > resp.usage.input_tokens
    # stateless: the same turn sent back as items renders the same prompt
    items = [{"role": "user", "content": "What is 2 plus 3?"},
             *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
                "arguments": c.arguments} for c in calls],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}]
    stateless = client.responses.create(model=SERVED_NAME, input=items, max_output_tokens=8,
                                        temperature=0, store=False)
    assert stateless.usage.input_tokens == follow.usage.input_tokens
    assert stateless.output_text == follow.output_text


@pytest.mark.parametrize("body,status,param", [
    ({"input": "hi", "bogus": 1}, 400, "bogus"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": -5}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": "hi", "colour": "red"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "tools": [ADD_TOOL], "tool_choice": {"type": "function", "name": "sub"}},
     400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, 400, None),
    ({"input": "hi", "model": "gpt-9"}, 404, "model"),
])
def test_bad_requests_get_openai_error_bodies(server, body, status, param):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert _post(server, {"input": "Hi", "max_output_tokens": 2}).status_code == 200


def test_client_raises_on_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="unknown parameter 'bogus'"):
        client.responses.create(model=SERVED_NAME, input="hi", extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=SERVED_NAME, input="hi", previous_response_id="resp_x")


def test_a_stream_left_early_aborts_its_request(server):
    aborted = metric(server.url, "octavo:requests_aborted_total")
    body = {"model": SERVED_NAME, "input": "Count from 1 to 500.", "max_output_tokens": 1500,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen >= 3:
                break
    deadline = time.time() + 30
    while metric(server.url, "octavo:requests_aborted_total") < aborted + 1:
        assert time.time() < deadline, "the abandoned stream's request was not aborted"
        time.sleep(0.2)


# ---- the pieces on their own -----------------------------------------------------------------

def test_output_items_from_reasoning_text_and_calls():
    items = OutputItems()
    events = items.feed([ReasoningText("let me "), ReasoningText("think"),
                         ContentDelta("Sure."), ToolCallDelta(0, "call_1", "add", '{"a": 1'),
                         ToolCallDelta(0, None, None, ', "b": 2}'),
                         ToolCallDelta(1, "call_2", "add", "{}")])
    events += items.finish("completed")
    assert _collapsed([e["type"] for e in events]) == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    reasoning, message, call, call2 = items.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert call["arguments"] == '{"a": 1, "b": 2}' and call["call_id"] == "call_1"
    assert call2["arguments"] == "{}" and call2["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] \
        == [0, 1, 2, 3]
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["status"] == "in_progress" and added["item"]["content"] == []
    assert items.assistant_message() == {
        "role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    empty = OutputItems()
    assert [e["type"] for e in empty.finish("incomplete")][-1] == "response.output_item.done"
    assert empty.items[0]["status"] == "incomplete" and empty.items[0]["content"][0]["text"] == ""


def test_reasoning_tokens_counted_from_the_tags():
    qwen = ReasoningEndRule(start_id=7, end_id=8, start_required=True)
    assert reasoning_token_count(qwen, [7, 1, 2, 8, 3, 4]) == 4
    assert reasoning_token_count(qwen, [1, 2, 8]) == 0      # no <think> first: no reasoning
    r1 = ReasoningEndRule(start_id=7, end_id=8, start_required=False)
    assert reasoning_token_count(r1, [1, 2, 8, 3]) == 3
    assert reasoning_token_count(r1, [1, 2]) == 2           # still reasoning at the end
    assert reasoning_token_count(None, [1, 2]) == 0


def test_input_items_become_chat_messages():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    got = input_messages([
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "5"}]}])
    assert got == [{"role": "developer", "content": "rules"},
                   {"role": "assistant", "content": "Let me add.", "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "add", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "5"}]


def test_store_is_lru_and_bounded_in_count_and_bytes():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(3):
        assert store.put(f"r{i}", {"i": i}, [])
    store.get("r0")                       # r1 is now the least recently used
    assert store.put("r3", {"i": 3}, [])
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 3
    big = [{"role": "user", "content": "x" * 4000}]
    assert store.put("b1", {}, big) and store.put("b2", {}, big)
    assert store.bytes <= 10_000 and len(store) <= 3
    assert not store.put("huge", {}, [{"content": "x" * 20_000}])
    assert store.get("huge") is None and store.bytes <= 10_000
    assert store.delete("b2") and not store.delete("b2")
    for rid in ("r0", "r2", "r3", "b1"):
        store.delete(rid)
    assert len(store) == 0 and store.bytes == 0
