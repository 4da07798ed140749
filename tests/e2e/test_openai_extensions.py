"""vLLM's extensions of the OpenAI requests on /v1/completions and /v1/chat/completions, over
HTTP against the real server: token-level sampling fields, return_token_ids,
return_tokens_as_token_ids, add_special_tokens, echo, request_id, usage on every chunk, and
max_tokens 0 with echo; bad values are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 8}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def ok(server, path: str, body: dict) -> dict:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def tokenize(server, text: str, add_special_tokens: bool = False) -> list[int]:
    return ok(server, "/tokenize", {"prompt": text,
                                    "add_special_tokens": add_special_tokens})["tokens"]


def test_token_level_sampling_fields_on_both_routes(server):
    allowed = sorted(set(tokenize(server, " the cat sat on a mat.")))
    for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        out = ok(server, path, {**GREEDY, **body, "allowed_token_ids": allowed,
                                "return_token_ids": True})
        assert set(out["choices"][0]["token_ids"]) <= set(allowed)
    free = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT})["choices"][0]["text"]
    assert "Paris" in free
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        out = ok(server, path, {**GREEDY, **body, "bad_words": ["Paris"], "max_tokens": 16,
                                "top_k": 40, "min_p": 0.0, "repetition_penalty": 1.0,
                                "min_tokens": 2, "spaces_between_special_tokens": False,
                                "skip_special_tokens": True, "vllm_xargs": {"k": 1}})
        choice = out["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert "Paris" not in text and out["usage"]["completion_tokens"] >= 2


def test_truncate_prompt_tokens_and_add_special_tokens(server):
    ids = tokenize(server, "Write about the sea. " * 3 + PROMPT)
    cut = ok(server, "/v1/completions", {**GREEDY, "prompt": ids, "truncate_prompt_tokens": 5,
                                         "return_token_ids": True})["choices"][0]
    direct = ok(server, "/v1/completions", {**GREEDY, "prompt": ids[-5:]})["choices"][0]
    assert cut["prompt_token_ids"] == ids[-5:] and cut["text"] == direct["text"]
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                               "truncate_prompt_tokens": 4,
                                               "return_token_ids": True})
    assert len(chat["prompt_token_ids"]) == 4 and chat["usage"]["prompt_tokens"] == 4
    # SmolLM2's tokenizer adds no special tokens itself: the flag is accepted and the ids agree
    for flag in (True, False):
        out = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 1,
                                             "add_special_tokens": flag,
                                             "return_token_ids": True})
        assert out["choices"][0]["prompt_token_ids"] == tokenize(server, PROMPT, flag)
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                               "add_special_tokens": True, "max_tokens": 1,
                                               "return_token_ids": True})
    rendered = ok(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert chat["prompt_token_ids"] == rendered


def test_return_token_ids_and_tokens_as_token_ids(server):
    out = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "logprobs": 2,
                                         "return_token_ids": True,
                                         "return_tokens_as_token_ids": True})
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(server, PROMPT)
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 8
    lps = choice["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in lps["top_logprobs"])
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "logprobs": True,
                                               "top_logprobs": 1, "return_token_ids": True,
                                               "return_tokens_as_token_ids": True})
    assert chat["prompt_token_ids"] == ok(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    ids = chat["choices"][0]["token_ids"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    # streamed: the prompt's ids in the first chunk, each chunk's own token ids after it
    chunks = events(server, "/v1/completions", {**GREEDY, "prompt": PROMPT,
                                                "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    chunks = events(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                                     "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks[1:] for ch in c["choices"] for t in ch["token_ids"]] == ids


def test_logprob_token_ids(server):
    listed = tokenize(server, " Paris is")
    out = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 2,
                                         "logprobs": 2, "logprob_token_ids": listed})
    for top in out["choices"][0]["logprobs"]["top_logprobs"]:
        assert {" Paris", " is"} <= set(top)
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "max_tokens": 2,
                                               "logprobs": True, "logprob_token_ids": listed})
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert {" Paris", " is"} <= {t["token"] for t in entry["top_logprobs"]}


def test_chat_echo(server):
    partial = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "My favourite colour is"}]
    body = {**GREEDY, "messages": partial, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = ok(server, "/v1/chat/completions", body)["choices"][0]["message"]
    echoed = ok(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]
    assert echoed["content"] == "My favourite colour is" + plain["content"]
    assert echoed["role"] == "assistant"
    chunks = events(server, "/v1/chat/completions", {**body, "echo": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == echoed["content"]
    # after a generation prompt the reply is the assistant's: a user's last message is not
    # echoed
    fresh = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "echo": True})
    again = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES})
    assert fresh["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


def test_request_id_names_the_response(server):
    out = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "request_id": "abc-1"})
    assert out["id"] == "cmpl-abc-1"
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                               "request_id": "abc-1"})
    assert chat["id"] == "chatcmpl-abc-1"
    chunks = events(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                                     "request_id": "abc-1"})
    assert {c["id"] for c in chunks} == {"chatcmpl-abc-1"}
    # the same id twice at once, and one shaped like another request's internal child id
    with httpx.Client(timeout=120) as http:
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(http.post, server.url + "/v1/chat/completions", headers=AUTH,
                                json={**GREEDY, "messages": MESSAGES, "request_id": rid,
                                      "n": 2, "temperature": 0.8})
                    for rid in ("same", "same", "same#0")]
            assert [f.result().status_code for f in futs] == [200, 200, 200]


def test_continuous_usage_stats(server):
    chunks = events(server, "/v1/completions", {
        **GREEDY, "prompt": PROMPT, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}})
    n_prompt = len(tokenize(server, PROMPT))
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    counts = [c["usage"]["completion_tokens"] for c in deltas]
    assert counts == sorted(counts) and counts[-1] == 8
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in deltas)
    chunks = events(server, "/v1/chat/completions", {
        **GREEDY, "messages": MESSAGES, "stream_options": {"include_usage": True,
                                                           "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert chunks[-2]["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    # without continuous_usage_stats the chunks carry usage null, as before
    chunks = events(server, "/v1/completions", {**GREEDY, "prompt": PROMPT,
                                                "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1])


def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(server):
    ids = tokenize(server, PROMPT)
    out = ok(server, "/v1/completions", {"model": SERVED_NAME, "prompt": PROMPT,
                                         "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) and lps["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in lps["token_logprobs"][1:])
    # the same prompt logprobs as an echo that generates
    full = ok(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "echo": True,
                                          "logprobs": 1})["choices"][0]["logprobs"]
    assert full["token_logprobs"][0] is None
    assert full["token_logprobs"][1:len(ids)] == pytest.approx(lps["token_logprobs"][1:],
                                                               abs=1e-4)
    chunks = events(server, "/v1/completions", {"model": SERVED_NAME, "prompt": PROMPT,
                                                "max_tokens": 0, "echo": True, "logprobs": 1})
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    streamed = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lps["token_logprobs"][1:],
                                                                 abs=1e-4)
    bad = post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": PROMPT,
                                           "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_streamed_echo_carries_the_prompt_logprobs(server):
    body = {**GREEDY, "prompt": PROMPT, "echo": True, "logprobs": 1}
    whole = ok(server, "/v1/completions", body)["choices"][0]
    chunks = events(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == whole["logprobs"]["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "allowed_token_ids": [-1]},
     "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": [""]}, "bad_words"),
    ("/v1/chat/completions", {"messages": MESSAGES, "bad_words": "Paris"}, "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "truncate_prompt_tokens": 10**6},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -2}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": [10**7]},
     "logprob_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                         "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "request_id": ""}, "request_id"),
    ("/v1/chat/completions", {"messages": MESSAGES, "request_id": "x" * 257}, "request_id"),
    ("/v1/completions", {"prompt": PROMPT, "return_token_ids": "maybe"}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "echo": 3}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "bad_words": ["a"]},
     "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True,
                         "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "spaces_between_special_token": False},
     "spaces_between_special_token"),
    ("/v1/completions", {"prompt": PROMPT, "stream": True,
                         "stream_options": {"continuous_usage": True}}, "continuous_usage"),
])
def test_bad_values_are_400s_naming_the_field(server, path, body, param):
    resp = post(server, path, {"model": SERVED_NAME, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    assert param in resp.json()["error"]["message"] or param == resp.json()["error"]["param"]


def test_max_logprobs_minus_one_lifts_the_cap(smollm_gguf, tmp_path):
    """`--max-logprobs -1` (vLLM's "no cap"): logprobs=-1 returns the whole vocabulary; a value
    below -1 stops the start, naming the flag."""
    import subprocess
    import sys

    from tests.e2e.conftest import start_server

    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "serve",
                           str(smollm_gguf), "--port", "0", "--max-logprobs", "-2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-logprobs" in done.stderr, done.stderr[-2000:]
    srv = start_server(smollm_gguf, tmp_path, "--max-logprobs", "-1")
    try:
        resp = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "logprobs": -1})
        assert resp.status_code == 200, resp.text
        (top,) = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) > 40_000  # SmolLM2's 49,152 tokens, less those that decode alike
    finally:
        srv.stop()
