"""use_beam_search and best_of through a real server, against the offline engine on the same
model."""
from __future__ import annotations

import httpx

from octavo import BeamSearchParams
from tests.e2e.conftest import API_KEY, SERVED_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, headers=AUTH,
                      timeout=120)


def test_beam_search_completions_match_the_offline_engine(server, smollm_llm):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 2,
                                          "best_of": 3, "use_beam_search": True,
                                          "length_penalty": 0.5, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    offline = smollm_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6,
                                                              length_penalty=0.5))[0]
    n_prompt = len(smollm_llm.get_tokenizer().encode(PROMPT))
    eos = smollm_llm.engine.setup.eos_token_ids
    assert [c["text"] for c in choices] == [
        smollm_llm.get_tokenizer().decode([t for t in seq.tokens[n_prompt:] if t not in eos],
                                          skip_special_tokens=True)
        for seq in offline.sequences[:2]]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] != choices[1]["text"]


def test_beam_search_chat_returns_n_beams(server):
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "n": 2,
        "use_beam_search": True, "early_stopping": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] > 0
    assert all(c["message"]["content"] for c in body["choices"])


def test_beam_search_and_best_of_refusals_name_the_field(server):
    cases = [
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "temperature": 0.8}, "temperature"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, None),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ]
    for extra, param in cases:
        r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        message = r.json()["error"]["message"]
        assert (param or "early_stopping") in message, (extra, message)


def test_best_of_returns_the_most_likely_sample(server):
    common = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11,
              "ignore_eos": True}
    every = _post(server, "/v1/completions", {**common, "n": 3, "logprobs": 0}).json()
    ranked = sorted(every["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = _post(server, "/v1/completions", {**common, "n": 1, "best_of": 3}).json()
    assert [c["text"] for c in best["choices"]] == [ranked[0]["text"]]
