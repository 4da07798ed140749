"""Hostile requests against a real server: each attack of issue 25 gets a 4xx that names the
problem, and afterwards the server is healthy, its admission counters are back to zero and a
normal request is served."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY, child_pids, metric, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Say hi"}]
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                "{% endfor %}")


def _post(url, path, body, headers=AUTH, timeout=120):
    if isinstance(body, str):  # raw JSON text: numbers past float's range
        return httpx.post(url + path, content=body, timeout=timeout,
                          headers={**headers, "content-type": "application/json"})
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def _assert_idle_and_serving(url, headers=AUTH):
    """Nothing in flight, nothing queued, and a normal request still served."""
    deadline = time.time() + 30
    while time.time() < deadline:
        if (metric(url, "octavo:frontend_requests_in_flight") == 0
                and metric(url, "octavo:frontend_queued_sequences") == 0
                and metric(url, "octavo:frontend_queued_prompt_tokens") == 0):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("admission counters did not return to zero")
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    r = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2},
              headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/chat/completions", {"messages": MESSAGES, "top_k": 2**63}, "top_k"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_k": 10**6}, "vocabulary"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -2**63 - 1}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "priority": 2**40}, "priority"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 100000}, "n must be <= 16"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, "n must be <= 16"),
    ("/v1/completions", {"prompt": "hi", "best_of": 10**9}, "best_of must be <= 16"),
    ("/v1/completions", {"prompt": ["hi"] * 400, "max_tokens": 1}, "sequences"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "n": 49000},
     "16"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [f"s{i}" for i in range(500)]},
     "--max-stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["x" * 5000]}, "--max-stop-length"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": [1] * 1000},
     "--max-stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"temperature": 1e400}', "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 10**30},
     "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": NESTED_LOOPS},
     "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(
            '{"type": "array", "items": ' * 80 + '{"type": "string"}' + "}" * 80)}}},
     "levels deep"),
    ("/v1/messages", {"model": "smol", "max_tokens": 2**64, "messages": MESSAGES},
     "max_tokens"),
    ("/v1/messages", {"model": "smol", "max_tokens": 4, "top_k": 2**63, "messages": MESSAGES},
     "top_k"),
])
def test_attacks_get_a_400_that_names_the_field(server, path, body, fragment):
    r = _post(server.url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"], err
    _assert_idle_and_serving(server.url)


def test_a_chunked_body_meets_the_size_limit(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 10000  # 400 kB > the fixture's 200 kB limit, with no Content-Length
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
    _assert_idle_and_serving(server.url)


def test_headers_and_keys(server):
    many = {**AUTH, **{f"x-h{i}": "1" for i in range(150)}}
    assert httpx.get(server.url + "/v1/models", headers=many).status_code == 431
    big = {**AUTH, "x-big": "a" * 40000}
    assert httpx.get(server.url + "/v1/models", headers=big).status_code == 431
    assert httpx.get(server.url + "/version").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401


@pytest.fixture(scope="module")
def keyless(smollm_gguf, tmp_path_factory):
    """No API key (so the Host allow-list is on), an admin key, trusted request templates and a
    short request timeout."""
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("keyless"), "--admin-api-key",
                       "admin-1", "--trust-request-chat-template", "--request-timeout", "3",
                       "--preprocess-timeout", "2", "--max-num-seqs", "4",
                       "--max-concurrent-connections", "6", "--allowed-origins", "*")
    yield srv
    srv.stop()


def test_a_hostile_template_is_stopped_and_does_not_freeze_the_server(keyless):
    async def run():
        async with httpx.AsyncClient(base_url=keyless.url, timeout=60) as c:
            slow = asyncio.ensure_future(c.post("/v1/chat/completions", json={
                "messages": MESSAGES, "chat_template": NESTED_LOOPS}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            health = await c.get("/health")
            health_s = time.monotonic() - started
            return await slow, health, health_s

    r, health, health_s = asyncio.run(run())
    assert r.status_code == 400 and "took longer than 2 s" in r.json()["error"]["message"]
    assert health.status_code == 200 and health_s < 1.0, health_s
    _assert_idle_and_serving(keyless.url, headers={})


def test_host_allow_list_admin_key_and_open_metrics(keyless):
    assert httpx.get(keyless.url + "/health").status_code == 200
    evil = httpx.get(keyless.url + "/v1/models", headers={"Host": "evil.example:8000"})
    assert evil.status_code == 400 and "not allowed" in evil.json()["error"]["message"]
    assert httpx.get(keyless.url + "/v1/models", headers={"Host": "localhost"}).status_code \
        == 200
    assert httpx.post(keyless.url + "/reset_prefix_cache").status_code == 401
    assert httpx.post(keyless.url + "/reset_prefix_cache",
                      headers={"Authorization": "Bearer admin-1"}).status_code == 200


def test_connection_limit_and_cors_without_credentials_for_any_origin(keyless):
    port = int(keyless.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        time.sleep(0.2)  # let the server accept them
        assert httpx.get(keyless.url + "/v1/models").status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.time() + 10
    while httpx.get(keyless.url + "/health").status_code != 200 and time.time() < deadline:
        time.sleep(0.1)
    r = httpx.options(keyless.url + "/v1/models", headers={
        "Origin": "http://anywhere.example", "Access-Control-Request-Method": "GET"})
    assert r.headers.get("access-control-allow-origin") in ("*", "http://anywhere.example")
    assert "access-control-allow-credentials" not in r.headers


def test_request_timeout_aborts_with_partial_usage(keyless):
    body = {"prompt": "Tell a long story", "max_tokens": 1500, "ignore_eos": True}
    r = _post(keyless.url, "/v1/completions", body, headers={})
    assert r.status_code == 504, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", keyless.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e[6:]) for e in events if '"error"' in e]
    assert errors and errors[0]["error"]["code"] == 504 and events[-1] == "data: [DONE]"
    _assert_idle_and_serving(keyless.url, headers={})


def test_a_slow_reader_holds_merged_output_not_a_backlog(keyless):
    """A client that stops reading: the server keeps one merged output for it, and the
    request ends (here by the request timeout) with every counter released."""
    sock = socket.create_connection(("127.0.0.1", int(keyless.url.rsplit(":", 1)[1])))
    body = json.dumps({"prompt": "Count", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    time.sleep(0.5)  # the client reads nothing meanwhile
    assert httpx.get(keyless.url + "/health", timeout=5).status_code == 200
    sock.close()
    _assert_idle_and_serving(keyless.url, headers={})


def test_sigkill_of_the_front_end_takes_the_core_with_it(smollm_gguf, tmp_path):
    srv = start_server(smollm_gguf, tmp_path)
    cores = child_pids(srv.proc.pid)
    assert cores
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in cores):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in cores), "the engine core outlived its front end"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_kv_budget_past_free_memory_stops_serve_with_the_flag_to_change(smollm_gguf):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "serve",
                           str(smollm_gguf), "--port", "0", "--kv-cache-memory", "10TB"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    tail = done.stderr.strip().splitlines()[-1]
    assert tail.startswith("octavo: error:") and "--kv-cache-memory" in tail, tail


def test_a_hung_core_turns_health_503_and_a_killed_one_fails_requests_at_once(smollm_gguf,
                                                                            tmp_path):
    import threading

    srv = start_server(smollm_gguf, tmp_path, "--engine-timeout", "2")
    try:
        core = child_pids(srv.proc.pid)[0]
        replies: list = []

        def long_request():
            replies.append(_post(srv.url, "/v1/completions", {
                "prompt": "Tell a story", "max_tokens": 1500, "ignore_eos": True}, headers={}))

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.5)
        os.kill(core, signal.SIGSTOP)  # hung: alive, silent, with work
        statuses = set()
        deadline = time.time() + 15
        while 503 not in statuses and time.time() < deadline:
            statuses.add(httpx.get(srv.url + "/health", timeout=5).status_code)
            time.sleep(0.2)
        assert 503 in statuses, statuses
        os.kill(core, signal.SIGCONT)
        deadline = time.time() + 15
        while httpx.get(srv.url + "/health", timeout=5).status_code != 200:
            assert time.time() < deadline, "health did not recover after the core resumed"
            time.sleep(0.2)
        started = time.time()
        os.kill(core, signal.SIGKILL)  # mid-request: the request fails at once
        worker.join(30)
        assert replies and replies[0].status_code == 500, replies
        assert time.time() - started < 10
        assert srv.proc.wait(30) != 0
        assert not _alive(core)
    finally:
        os.kill(core, signal.SIGCONT) if _alive(core) else None
        srv.stop()
