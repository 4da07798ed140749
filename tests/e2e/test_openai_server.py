"""The OpenAI-compatible server, driven by the official `openai` client and by httpx."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from octavo import SamplingParams
from tests.e2e.conftest import API_KEY, SERVED_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=kw.pop("headers", AUTH), timeout=120,
                      **kw)


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").status_code == 401  # only /health, /metrics open
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]
    ids = [m.id for m in client.models.list().data]
    assert ids == [SERVED_NAME, "smollm2"]


def test_chat_greedy_equals_offline_chat(client, smollm_llm):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=24,
                                          temperature=0)
    offline = smollm_llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0),
                              use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].message.content == offline.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == len(offline.token_ids)
    cached = resp.usage.prompt_tokens_details.cached_tokens  # shared system prompt blocks
    assert 0 <= cached < resp.usage.prompt_tokens and cached % 16 == 0


def test_chat_stream_concatenates_to_non_stream(client):
    kw = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=30, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_usage_matches_tokenize(server, client):
    prompt = "The capital of France is"
    resp = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                     temperature=0)
    count = _post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    assert resp.usage.prompt_tokens == count
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    detok = _post(server, "/detokenize",
                  {"tokens": _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]})
    assert detok.json()["prompt"] == prompt
    chat_count = _post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2)
    assert chat.usage.prompt_tokens == chat_count


def test_completion_stream_n_echo_logprobs(client):
    kw = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == full.choices[0].text
    many = client.completions.create(model=SERVED_NAME, prompt=["a", "b"], n=2, max_tokens=4,
                                     temperature=0.9, seed=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    echo = client.completions.create(**kw, echo=True)
    assert echo.choices[0].text == "Once upon a time" + full.choices[0].text
    lp = client.completions.create(**kw, logprobs=3)
    lps = lp.choices[0].logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == 10
    assert "".join(lps.tokens) == full.choices[0].text
    assert all(1 <= len(t) <= 4 for t in lps.top_logprobs)
    echo_lp = client.completions.create(**kw, echo=True, logprobs=1)
    assert echo_lp.choices[0].logprobs.token_logprobs[0] is None


def test_chat_logprobs_and_extras(client):
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, seed=1, presence_penalty=0.1, frequency_penalty=0.1, user="u1",
        logit_bias={"28": -5}, stop=["zzz"], n=1,
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": False, "stop_token_ids": [2],
                    "include_stop_str_in_output": False, "skip_special_tokens": True,
                    "add_generation_prompt": True, "chat_template_kwargs": {},
                    "priority": 0, "cache_salt": "abc"})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    multi = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=5,
                                           n=3, temperature=1.0, max_completion_tokens=5)
    assert [c.index for c in multi.choices] == [0, 1, 2]


@pytest.mark.parametrize("body, status, fragment", [
    ({"messages": MESSAGES, "foo": 1}, 400, "foo"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema is required"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "needs the server to run with --enable-auto-tool-choice and --tool-call-parser"),
    ({"messages": MESSAGES, "guided_json": {}}, 400, "guided_json"),
    ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"messages": MESSAGES, "top_p": 2}, 400, "top_p"),
    ({"messages": MESSAGES, "n": 0}, 400, "n must be"),
    ({"messages": MESSAGES, "max_tokens": 5000}, 400, "max_model_len"),
    ({"messages": MESSAGES, "top_logprobs": 50, "logprobs": True}, 400, "logprobs"),
    ({"messages": MESSAGES, "logit_bias": {"999999": 1}}, 400, "vocabulary"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ({"messages": MESSAGES, "model": "nope"}, 404, "nope"),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
])
def test_bad_chat_requests(server, body, status, fragment):
    r = _post(server, "/v1/chat/completions", {"model": SERVED_NAME, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status and "type" in err
    assert _post(server, "/v1/chat/completions",
                 {"messages": MESSAGES, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x " * 3000}, "max_model_len"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "n": 4, "best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [99999999]}, "prompt token ids"),
    ({}, "prompt"),
])
def test_bad_completion_requests(server, body, fragment):
    r = _post(server, "/v1/completions", {"model": SERVED_NAME, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_malformed_json_auth_size_and_cors(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = _post(server, "/v1/completions", {"prompt": "x" * 300000})
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
    r = httpx.options(server.url + "/v1/models", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "GET"})
    assert r.headers.get("access-control-allow-origin") == "http://example.com"
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_exported(server, client):
    client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("octavo:prompt_tokens_total", "octavo:generation_tokens_total",
                 "octavo:request_success_total", "octavo:time_to_first_token_seconds_bucket",
                 "octavo:time_per_output_token_seconds_bucket",
                 "octavo:e2e_request_latency_seconds_bucket",
                 "octavo:request_queue_time_seconds_bucket", "octavo:num_requests_running",
                 "octavo:num_requests_waiting", "octavo:kv_cache_usage_perc",
                 "octavo:num_preemptions_total", "octavo:requests_rejected_total"):
        assert name in text, name
    assert 'finished_reason="length"' in text


def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, json={
            "messages": MESSAGES, "max_tokens": 3, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_prefix_cache_reported_in_usage_and_metrics(server, client):
    prefix = "You are a meticulous assistant. " * 120  # ~840 tokens, shared
    first = client.completions.create(model=SERVED_NAME, prompt=prefix + "Question one?",
                                      max_tokens=2)
    second = client.completions.create(model=SERVED_NAME, prompt=prefix + "Question two?",
                                       max_tokens=2)
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert hit % 16 == 0 and hit >= second.usage.prompt_tokens - 20  # only the suffix computed
    from tests.e2e.conftest import metric
    assert metric(server.url, "octavo:prefix_cache_hits_total") >= hit
    assert metric(server.url, "octavo:prefix_cache_queries_total") >= \
        first.usage.prompt_tokens + second.usage.prompt_tokens
    salted = client.completions.create(model=SERVED_NAME, prompt=prefix + "Question two?",
                                       max_tokens=2, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert _post(server, "/reset_prefix_cache", {}).status_code == 200
    third = client.completions.create(model=SERVED_NAME, prompt=prefix + "Question two?",
                                      max_tokens=2)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
