"""generation_config.json's sampling settings are the server's request defaults too."""
from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import SERVED_NAME, start_server
from tests.parity.test_tiny_models import _build


def _completions(url: str, body: dict) -> list[str]:
    texts = []
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"model": SERVED_NAME, **body}, timeout=60)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def test_server_uses_generation_config_defaults(tmp_path, smollm_oracle_folder):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    srv = start_server(folder, tmp_path, "--max-model-len", "256", "--kv-cache-memory", "16MiB")
    try:
        prompt = {"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True}
        # No temperature in the request: the model's default (0) makes both runs greedy.
        first, second = _completions(srv.url, prompt)
        assert first == second
        # A request's own temperature still wins: two samples of a random model differ.
        a, b = _completions(srv.url, {**prompt, "temperature": 1.0})
        assert a != b
    finally:
        srv.stop()
