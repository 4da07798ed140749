"""POST /v1/embeddings on a server of all-MiniLM-L6-v2 (task embed by default: an encoder): the
OpenAI client's embeddings equal LLM.embed's (float and base64), usage counts the prompt tokens,
and bad input is a 400 naming the field; a generation endpoint on it is a 400 too. A server
of a causal LM serves embeddings beside its completions."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    from octavo.model_source import pull

    folder = pull("all-minilm-l6-v2")
    srv = start_server(folder, tmp_path_factory.mktemp("embed"), "--api-key", API_KEY,
                       "--max-model-len", "512")
    yield srv
    srv.stop()


def test_embeddings_as_the_openai_client_reads_them(embed_server):
    openai = pytest.importorskip("openai")
    from octavo import LLM

    texts = ["A man is eating food.", "Le chat dort.", "ok"]
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY)
    reply = client.embeddings.create(model="smol", input=texts)
    got = np.array([d.embedding for d in reply.data])
    packed = client.embeddings.create(model="smol", input=texts, encoding_format="base64")
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    try:
        expected = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    finally:
        llm.engine.shutdown()
    assert np.allclose(got, expected, atol=1e-5)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    raw = httpx.post(embed_server.url + "/v1/embeddings", headers=AUTH, timeout=60, json={
        "input": texts, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                        for d in raw["data"]])
    assert np.allclose(decoded, got, atol=1e-6) and len(packed.data) == 3
    ids = httpx.post(embed_server.url + "/v1/embeddings", headers=AUTH, timeout=60, json={
        "input": [101, 1037, 2158, 102]}).json()
    assert len(ids["data"][0]["embedding"]) == 384 and ids["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": "word " * 600}, "input"),
    ({"input": "hi", "dimensions": 8}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, None),
])
def test_bad_embedding_requests_are_400s(embed_server, body, param):
    reply = httpx.post(embed_server.url + "/v1/embeddings", headers=AUTH, timeout=60, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if param is not None:
        assert error["param"] == param, error


def test_generation_on_an_embedding_server_is_refused(embed_server):
    reply = httpx.post(embed_server.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "hello", "max_tokens": 2})
    assert reply.status_code == 400 and "task embed" in reply.text


def test_a_generating_server_also_embeds(server):
    """SmolLM2 (a causal LM, task generate): a completion and embeddings at once, both
    answered; the embedding is the last token's state, normalized."""
    from concurrent.futures import ThreadPoolExecutor

    def complete():
        return httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})

    def embed():
        return httpx.post(server.url + "/v1/embeddings", headers=AUTH, timeout=60,
                          json={"input": ["The capital of France is", "def fib(n):"]})

    with ThreadPoolExecutor(2) as pool:
        text, vectors = pool.submit(complete), pool.submit(embed)
        text, vectors = text.result(), vectors.result()
    assert text.status_code == 200 and vectors.status_code == 200, vectors.text
    data = np.array([d["embedding"] for d in vectors.json()["data"]])
    assert data.shape == (2, 576) and np.allclose(np.linalg.norm(data, axis=1), 1, atol=1e-4)


def test_pooling_route(embed_server, server):
    """vLLM's /pooling: the engine's task by default (the embedding /v1/embeddings gives), or a
    vector per token (token_embed: nested lists, or their float32 bytes in base64); on
    SmolLM2's server, rewards from the LM head at step tags."""
    texts = ["A man is eating food.", "ok"]
    pooled = httpx.post(embed_server.url + "/pooling", headers=AUTH, timeout=60,
                        json={"input": texts}).json()
    embedded = httpx.post(embed_server.url + "/v1/embeddings", headers=AUTH, timeout=60,
                          json={"input": texts}).json()
    assert pooled["data"][0]["object"] == "pooling" and pooled["id"].startswith("pool-")
    assert np.allclose([d["data"] for d in pooled["data"]],
                       [d["embedding"] for d in embedded["data"]], atol=1e-6)
    tokens = httpx.post(embed_server.url + "/pooling", headers=AUTH, timeout=60, json={
        "input": texts, "task": "token_embed"}).json()
    shapes = [np.array(d["data"]).shape for d in tokens["data"]]
    assert shapes == [(n, 384) for n in (8, 3)] and tokens["usage"]["prompt_tokens"] == 11
    packed = httpx.post(embed_server.url + "/pooling", headers=AUTH, timeout=60, json={
        "input": texts[0], "task": "token_embed", "encoding_format": "base64"}).json()
    flat = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), "<f4")
    assert np.allclose(flat.reshape(8, 384), tokens["data"][0]["data"], atol=1e-6)
    refused = httpx.post(embed_server.url + "/pooling", headers=AUTH, timeout=60, json={
        "input": "ok", "task": "reward"})
    assert refused.status_code == 400 and "encoder" in refused.json()["error"]["message"]
    rewards = httpx.post(server.url + "/pooling", headers=AUTH, timeout=60, json={
        "input": [[504, 30, 905, 30]], "task": "reward", "step_tag_id": 30,
        "returned_token_ids": [648, 387]}).json()
    values = np.array(rewards["data"][0]["data"])
    assert values.shape == (2, 2) and np.allclose(values.sum(1), 1, atol=1e-5)
    missing = httpx.post(server.url + "/pooling", headers=AUTH, timeout=60, json={
        "input": "x", "task": "reward"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
