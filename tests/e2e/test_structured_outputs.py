"""Structured output through the server: OpenAI `response_format` (json_object, json_schema) and
octavo's `structured_outputs` on /v1/chat/completions and /v1/completions, streaming and not;
bad specs are a 400 naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"]}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, headers=AUTH,
                      timeout=120)


def test_chat_json_schema_stream_and_not(client):
    kw = dict(model=SERVED_NAME, messages=ASK, max_tokens=80, response_format=SCHEMA_FORMAT)
    full = client.chat.completions.create(**kw, temperature=0)
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(**kw, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    sampled = client.chat.completions.create(
        **kw, temperature=1.0, seed=5, n=3,
        extra_body={"structured_outputs": None})  # null is "not given"
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_json_object_and_completions_extras(client):
    obj = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "A JSON object with the keys x and y:"}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    reg = client.completions.create(
        model=SERVED_NAME, prompt=["My phone number is", "Call me at"], max_tokens=12, n=2,
        temperature=0.9, seed=1, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert len(reg.choices) == 4
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) for c in reg.choices)
    pick = client.completions.create(
        model=SERVED_NAME, prompt="The sky is", max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert pick.choices[0].text in ("blue", "green") and pick.choices[0].finish_reason == "stop"
    fmt = client.completions.create(model=SERVED_NAME, prompt="A person as JSON:", max_tokens=80,
                                    temperature=0, extra_body={"response_format": SCHEMA_FORMAT})
    jsonschema.validate(json.loads(fmt.choices[0].text), PERSON)


def test_max_tokens_cut_is_length(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=4,
                                          temperature=0, response_format=SCHEMA_FORMAT)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "response_format.json_schema.schema is not a usable JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "structured_outputs.regex is not a valid regular expression"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     "structured_outputs.grammar is not a valid EBNF grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs",
     "unknown parameter 'structured_outputs.pattern'"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 3}, None, "min_tokens must be 0"),
])
def test_bad_specs_are_400_naming_the_field(server, body, param, fragment):
    for path, base in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "Hi"})):
        r = _post(server, path, {**base, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert fragment in err["message"], err
        if param is not None:
            assert err["param"] == param
    ok = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200
