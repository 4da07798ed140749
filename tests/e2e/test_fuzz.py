"""Fuzzing a real server: hypothesis-made hostile bodies on the generation routes, and
schemathesis over every route of the server's OpenAPI schema. Invariants: never a 5xx, never a
hang, and afterwards the server is healthy, its admission counters are back to zero and a
normal request is served. The case counts are printed (pytest -s) for the issue note."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import start_server
from tests.e2e.test_hardening import _assert_idle_and_serving

CASES = 500  # per route
TIMEOUT_S = 30  # no single case may take longer: a hang fails the test

# Numbers that break naive code: past int64, past float, negative, NaN and infinities.
hostile_ints = st.one_of(st.integers(-3, 40), st.sampled_from(
    [2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, -1, 0]),
    st.integers(-2**70, 2**70))
hostile_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                           st.sampled_from([0.0, 1.0, -0.0, 1e308, -1e308]))
text = st.one_of(st.text(max_size=40), st.sampled_from(
    ["", "\x00", "\u202e", "\ud800", "{{ 7*7 }}", "{% for a in range(99999) %}x{% endfor %}",
     "x" * 5000]))
scalars = st.one_of(st.none(), st.booleans(), hostile_ints, hostile_floats, text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)

SAMPLING_FIELDS = {
    "n": hostile_ints, "best_of": hostile_ints, "temperature": hostile_floats,
    "top_p": hostile_floats, "top_k": hostile_ints, "min_p": hostile_floats,
    "seed": hostile_ints, "priority": hostile_ints, "presence_penalty": hostile_floats,
    "frequency_penalty": hostile_floats, "repetition_penalty": hostile_floats,
    "min_tokens": hostile_ints, "logprobs": st.one_of(st.booleans(), hostile_ints),
    "top_logprobs": hostile_ints, "prompt_logprobs": hostile_ints,
    "stop": st.one_of(text, st.lists(text, max_size=80)),
    "stop_token_ids": st.lists(hostile_ints, max_size=80),
    "logit_bias": st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 10**6).map(str)),
                                  hostile_floats, max_size=5),
    "stream": st.booleans(), "stream_options": json_values, "use_beam_search": st.booleans(),
    "response_format": json_values, "structured_outputs": json_values,
    "chat_template": text, "chat_template_kwargs": json_values, "cache_salt": text,
    "ignore_eos": st.booleans(), "echo": st.booleans(), "tools": json_values,
    "tool_choice": json_values, "unknown_field": json_values, "model": text,
}
# Small valid output lengths (the fuzz server's context is short too), or hostile ones.
max_tokens = st.one_of(st.integers(1, 4), hostile_ints)
messages = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                             "tool", "wizard"]),
                                    "content": st.one_of(text, json_values)}), max_size=3),
    json_values)
prompts = st.one_of(text, st.lists(hostile_ints, max_size=6), st.lists(text, max_size=3),
                    json_values)


# Values a real client sends: the base of bodies that reach the engine, so that a hostile field
# next to them is met where it does harm (sampling, the core), not only by the schema.
VALID_FIELDS = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 100), "min_p": st.floats(0, 1), "seed": st.integers(-2**63, 2**63 - 1),
    "priority": st.integers(-5, 5), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}


def _body(required_valid: dict, required_hostile: dict,
          hostile: dict) -> st.SearchStrategy[dict]:
    """Half wholly hostile bodies; half valid ones with one to three hostile fields."""
    wild = st.fixed_dictionaries(required_hostile, optional={
        name: value for name, value in hostile.items() if name not in required_hostile})
    base = st.fixed_dictionaries(required_valid, optional=VALID_FIELDS)
    field = st.sampled_from(sorted(hostile)).flatmap(
        lambda name: hostile[name].map(lambda value: (name, value)))
    spiked = st.tuples(base, st.lists(field, min_size=1, max_size=3)).map(
        lambda t: {**t[0], **dict(t[1])})
    return st.one_of(wild, spiked)


ANTHROPIC_FIELDS = {"top_k": hostile_ints, "top_p": hostile_floats, "stream": st.booleans(),
                    "temperature": hostile_floats, "stop_sequences": st.lists(text, max_size=80),
                    "system": json_values, "tools": json_values, "max_tokens": hostile_ints}
HI = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/chat/completions": _body({"messages": st.just(HI), "max_tokens": st.integers(1, 4)},
                                  {"messages": messages, "max_tokens": max_tokens},
                                  {**SAMPLING_FIELDS, "messages": messages}),
    "/v1/completions": _body({"prompt": st.text(min_size=1, max_size=20),
                              "max_tokens": st.integers(1, 4)},
                             {"prompt": prompts, "max_tokens": max_tokens},
                             {**SAMPLING_FIELDS, "prompt": prompts}),
    "/v1/messages": _body({"model": st.just("smol"), "messages": st.just(HI),
                           "max_tokens": st.integers(1, 4)},
                          {"model": st.just("smol"), "messages": messages,
                           "max_tokens": max_tokens}, {**ANTHROPIC_FIELDS, "messages": messages}),
}


@pytest.fixture(scope="module")
def fuzz_server(smollm_gguf, tmp_path_factory):
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("fuzz"), "--max-model-len", "96",
                       "--max-num-seqs", "8", "--preprocess-timeout", "5")
    yield srv
    srv.stop()


def _encode(body) -> bytes:
    """JSON with Python's NaN/Infinity literals, as some clients send them."""
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("route", list(ROUTES))
def test_hypothesis_bodies_never_get_a_5xx(fuzz_server, route):
    seen = {"cases": 0, "statuses": {}}
    client = httpx.Client(base_url=fuzz_server.url, timeout=TIMEOUT_S)

    @settings(max_examples=CASES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ROUTES[route])
    def one(body):
        r = client.post(route, content=_encode(body),
                        headers={"content-type": "application/json"})
        seen["cases"] += 1
        seen["statuses"][r.status_code] = seen["statuses"].get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text[:500])

    one()
    print(f"\nfuzz {route}: {seen['cases']} cases, statuses {seen['statuses']}")
    _assert_idle_and_serving(fuzz_server.url, headers={})


@pytest.mark.parametrize("raw", [
    b"\xff\xfe{\"prompt\": \"x\"}", b'{"prompt": "\xc3\x28"}', b"[" * 100000 + b"]" * 100000,
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"prompt": "x", "max_tokens": 1e999}',
    b"", b"null", b"[]", b'{"prompt": NaN}', b"\x00" * 1000])
def test_malformed_bodies_get_a_4xx(fuzz_server, raw):
    for route in ROUTES:
        r = httpx.post(fuzz_server.url + route, content=raw, timeout=TIMEOUT_S,
                       headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (route, raw[:40], r.text[:300])
    _assert_idle_and_serving(fuzz_server.url, headers={})


def test_schemathesis_over_every_route(fuzz_server):
    import schemathesis

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    counts = {"cases": 0, "operations": 0}

    for result in schema.get_all_operations():
        operation = result.ok()
        counts["operations"] += 1
        strategy = operation.as_strategy()

        @settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def one(case):
            response = case.call(base_url=fuzz_server.url, timeout=TIMEOUT_S)
            counts["cases"] += 1
            assert response.status_code < 500, (case.path, case.body, response.text[:500])

        one()
    assert counts["operations"] >= 10
    print(f"\nschemathesis: {counts['operations']} operations, {counts['cases']} cases")
    _assert_idle_and_serving(fuzz_server.url, headers={})
