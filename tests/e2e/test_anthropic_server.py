"""The Anthropic Messages API, driven by the official `anthropic` client and by httpx."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from octavo import SamplingParams
from tests.e2e.conftest import API_KEY, SERVED_NAME


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # sampling fields travel as extra_body with newer SDKs


def test_message_equals_offline_chat(client, smollm_llm):
    msg = client.messages.create(model=SERVED_NAME, max_tokens=20, extra_body=GREEDY,
                                 system="You are terse.", messages=MESSAGES)
    offline = smollm_llm.chat([{"role": "system", "content": "You are terse."}, *MESSAGES],
                              SamplingParams(max_tokens=20, temperature=0),
                              use_tqdm=False)[0].outputs[0]
    assert msg.content[0].type == "text" and msg.content[0].text == offline.text
    assert msg.role == "assistant" and msg.type == "message"
    assert msg.stop_reason == ("max_tokens" if offline.finish_reason == "length" else "end_turn")
    assert msg.usage.output_tokens == len(offline.token_ids)
    count = client.messages.count_tokens(model=SERVED_NAME, system="You are terse.",
                                         messages=MESSAGES)
    assert count.input_tokens == msg.usage.input_tokens


def test_stream_event_sequence(client):
    kw = dict(model=SERVED_NAME, max_tokens=16, extra_body=GREEDY,
              messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    full = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"] or \
        kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"ping", "content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == full.stop_reason
    assert delta.usage.output_tokens == full.usage.output_tokens


def test_stop_sequences_and_top_k(client):
    full = client.messages.create(model=SERVED_NAME, max_tokens=20, extra_body=GREEDY,
                                  messages=MESSAGES)
    stop = full.content[0].text[4:8]
    cut = client.messages.create(model=SERVED_NAME, max_tokens=20, messages=MESSAGES,
                                 stop_sequences=[stop],
                                 extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full.content[0].text[:full.content[0].text.index(stop)]


@pytest.mark.parametrize("body, status", [
    ({"messages": MESSAGES}, 400),  # max_tokens is required
    ({"messages": MESSAGES, "max_tokens": 5, "tools": [{"name": "t"}]}, 400),
    ({"messages": MESSAGES, "max_tokens": 5, "temperature": 3}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5}, 400),
    ({"messages": MESSAGES, "max_tokens": 5, "model": "other"}, 404),
])
def test_errors_have_anthropic_shape(server, body, status):
    r = httpx.post(server.url + "/v1/messages", json={"model": SERVED_NAME, **body},
                   headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["message"]
    assert err["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_auth_by_x_api_key_or_bearer(server):
    body = {"model": SERVED_NAME, "max_tokens": 2, "messages": MESSAGES}
    assert httpx.post(server.url + "/v1/messages", json=body).status_code == 401
    assert httpx.post(server.url + "/v1/messages", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "bad"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
