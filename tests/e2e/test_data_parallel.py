"""Data parallelism on the server (`--data-parallel-size 2`: two engine core processes, a core
each, behind one front end): the same greedy outputs as one core, requests sharing a prompt
prefix placed on the replica that cached it, and a replica killed mid-run failing only its own
requests while the other serves on."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server
from tests.executor.procs import gone

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "import numpy as np\n", "Water boils at",
           "My favourite book is", "1, 2, 3, 5, 8,"]


@pytest.fixture(scope="module")
def dp_server(smollm_gguf, tmp_path_factory):
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("dp"), "--api-key", API_KEY,
                       "--data-parallel-size", "2")
    yield srv
    srv.stop()


def _complete(url: str, prompt: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def _batch(url: str) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["text"] for r in replies]


def _per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(
        rf'^{re.escape(name)}{{engine="(\d+)"}} (\S+)$', text, re.M)}


def _core_pids(srv) -> dict[int, int]:
    return {int(m[1]): int(m[2]) for m in re.finditer(
        r"engine core process (\d+) \(pid (\d+)\) ready", srv.log())}


def test_two_replicas_give_one_cores_greedy_outputs(dp_server, server):
    """A mixed batch of concurrent requests, spread over both replicas, against the
    single-core server on the same model."""
    assert _batch(dp_server.url) == _batch(server.url)
    running = _per_engine(dp_server.url, "octavo:prefix_cache_queries_total")
    assert set(running) == {"0", "1"} and all(v > 0 for v in running.values()), running


def test_a_shared_prefix_goes_to_the_replica_that_cached_it(dp_server):
    before = _per_engine(dp_server.url, "octavo:prefix_cache_hits_total")
    prefix = "You are a careful assistant. " * 12  # well over two blocks of tokens
    for i in range(4):
        assert _complete(dp_server.url, f"{prefix} Question {i}:", 4).status_code == 200
    after = _per_engine(dp_server.url, "octavo:prefix_cache_hits_total")
    gained = sorted(after[e] - before.get(e, 0) for e in after)
    assert gained[0] == 0 and gained[1] >= 3 * 32, (before, after)  # three hits, one replica


def test_a_killed_replica_fails_only_its_requests(smollm_gguf, tmp_path):
    srv = start_server(smollm_gguf, tmp_path, "--api-key", API_KEY, "--data-parallel-size", "2")
    try:
        pids = _core_pids(srv)
        assert sorted(pids) == [0, 1]
        replies: list[httpx.Response] = []

        def long_request(prompt: str):
            replies.append(_complete(srv.url, prompt, 1500))

        workers = [threading.Thread(target=long_request, args=(p,)) for p in PROMPTS[:2]]
        for w in workers:  # the least loaded replica: one on each
            w.start()
            time.sleep(0.3)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        for w in workers:
            w.join(180)
        assert sorted(r.status_code for r in replies) == [200, 500], [r.text for r in replies]
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert _complete(srv.url, "Hello").status_code == 200  # the other replica serves
        up = _per_engine(srv.url, "octavo:engine_core_up")
        assert up == {"0": 1.0, "1": 0.0}, up
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_replicas_whose_experts_span_them_die_together(tmp_path, smollm_oracle_folder):
    """Expert parallelism over two replicas (a tiny random Qwen3-MoE): one replica killed
    mid-run takes the other's experts away, so the front end stops the other too: both
    streams end with an error event at once (none waits on the dead replica's experts), the
    server exits as it does when its one core dies, and no core process is left."""
    from tests.parity.test_tiny_models import _build

    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    srv = start_server(folder, tmp_path, "--api-key", API_KEY, "--data-parallel-size", "2",
                       "--enable-expert-parallel", "--max-model-len", "256")
    try:
        pids = _core_pids(srv)
        assert sorted(pids) == [0, 1]
        ended: list[str] = []
        started = threading.Barrier(3)

        def stream(prompt: str):
            with httpx.stream("POST", srv.url + "/v1/completions", headers=AUTH, timeout=60,
                              json={"model": "smol", "prompt": prompt, "max_tokens": 240,
                                    "temperature": 0, "ignore_eos": True,
                                    "stream": True}) as reply:
                text, first = "", True
                for chunk in reply.iter_text():
                    text += chunk
                    if first:
                        first = False
                        started.wait(30)
                ended.append(text)

        workers = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:2]]
        for w in workers:  # the least loaded replica: one on each
            w.start()
            time.sleep(0.2)
        started.wait(30)
        os.kill(pids[1], signal.SIGKILL)
        for w in workers:
            w.join(30)
        # each stream ends with the API's error event, not cut off
        assert len(ended) == 2 and all('"engine is dead: ' in text for text in ended), ended
        srv.proc.wait(30)  # every core is dead: the server exits, as with one core
        assert gone([pids[0]], 15.0)
    finally:
        srv.stop()
