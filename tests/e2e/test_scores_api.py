"""vLLM's scoring endpoints on a server of a tiny random cross-encoder
(BertForSequenceClassification, one label): /score pairs and one-against-many equal LLM.score's;
/rerank (and /v1, /v2) orders the documents by score, cuts to top_n and returns the documents
when asked; /classify gives the sigmoid and the label; bad input is a 400 naming the field."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat",
        "berlin is the capital of germany", "france is in europe"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from octavo.model_source import pull
    from tests.parity.test_embeddings import _tiny_cross_encoder

    folder, _ = _tiny_cross_encoder(tmp_path_factory.mktemp("cross"), pull("all-minilm-l6-v2"),
                                    1)
    srv = start_server(folder, tmp_path_factory.mktemp("scores"), "--api-key", API_KEY,
                       "--max-model-len", "128")
    yield srv, folder
    srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, headers=AUTH, timeout=60, json=body)


def test_scores_rerank_and_classify(cross_encoder):
    from octavo import LLM

    srv, folder = cross_encoder
    llm = LLM(str(folder), dtype="float32")
    try:
        expected = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
        pair = llm.score([DOCS[0], DOCS[1]], [DOCS[2], DOCS[3]], use_tqdm=False)
    finally:
        llm.engine.shutdown()
    reply = _post(srv, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert np.allclose([d["score"] for d in reply["data"]], expected, atol=1e-6)
    assert reply["usage"]["prompt_tokens"] > 0
    pairs = _post(srv, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert np.allclose([d["score"] for d in pairs["data"]],
                       [o.outputs.score for o in pair], atol=1e-6)
    best = list(np.argsort(expected)[::-1])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = _post(srv, path, {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert [r["index"] for r in ranked["results"]] == best[:3], ranked
        assert ranked["results"][0]["document"]["text"] == DOCS[best[0]]
    bare = _post(srv, "/rerank", {"query": QUERY, "documents": DOCS,
                                  "return_documents": False}).json()
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0]
    classes = _post(srv, "/classify", {"input": DOCS[:2]}).json()["data"]
    assert [c["num_classes"] for c in classes] == [1, 1] and classes[0]["label"] == "LABEL_0"
    assert 0 < classes[0]["probs"][0] < 1


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ("/rerank", {"query": "", "documents": DOCS}, "documents"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 4}, "input"),
])
def test_bad_scoring_requests_are_400s(cross_encoder, path, body, param):
    reply = _post(cross_encoder[0], path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
