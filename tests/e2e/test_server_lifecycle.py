"""Concurrency, client disconnects, admission control, SIGTERM and engine death."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY, child_pids, idle_within, metric, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "The lighthouse keeper counted the stairs again. " * 160  # ~1,600 tokens


def test_32_concurrent_streams_complete(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json={
                "prompt": f"Story {i}: once upon a time", "max_tokens": 24, "stream": True,
                "temperature": 0.8, "seed": i}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(f == "length" and t for t, f in results)
    assert idle_within(server.url, 2.0)


def _disconnect_stream_after(url: str, body: dict, chunks: int) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= chunks:
                    break  # closing the stream drops the connection


def _disconnect_by_timeout(url: str, path: str, body: dict, seconds: float) -> None:
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + path, json=body, headers=AUTH, timeout=seconds)


def test_disconnects_abort_without_disturbing_others(server):
    before_aborts = metric(server.url, "octavo:requests_aborted_total")
    results: list = []

    def normal(i: int) -> None:
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300, json={
            "prompt": f"Count to ten: {i}", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True})
        results.append((r.status_code, r.json()["choices"][0]["finish_reason"]))

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    quitters = [
        # mid-prefill, streaming and not (a long prompt; gone before its first token)
        threading.Thread(target=_disconnect_by_timeout, args=(
            server.url, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 50,
                                            "stream": True}, 0.2)),
        threading.Thread(target=_disconnect_by_timeout, args=(
            server.url, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 50}, 0.2)),
        # mid-decode, streaming and not
        threading.Thread(target=_disconnect_stream_after, args=(
            server.url, {"prompt": "Write a long story.", "max_tokens": 1000,
                         "ignore_eos": True}, 5)),
        threading.Thread(target=_disconnect_by_timeout, args=(
            server.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": 1000, "ignore_eos": True}, 1.5)),
    ]
    for t in quitters:
        t.start()
    for t in quitters + threads:
        t.join(300)
    assert results == [(200, "length")] * 4
    assert idle_within(server.url, 1.0)
    assert metric(server.url, "octavo:requests_aborted_total") - before_aborts == 4


def test_admission_control_and_sigterm(smollm_gguf, tmp_path):
    srv = start_server(smollm_gguf, tmp_path, "--max-queued-requests", "4", "--max-num-seqs",
                       "4")
    try:
        async def one(client: httpx.AsyncClient, i: int):
            r = await client.post("/v1/completions", json={
                "prompt": f"Request {i}", "max_tokens": 16, "ignore_eos": True})
            return r.status_code, r.headers.get("retry-after"), r.json()

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                return await asyncio.gather(*(one(c, i) for i in range(40)))

        started = time.time()
        results = asyncio.run(burst())
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(ok) + len(refused) == 40 and refused and ok
        assert all(r[1] is not None and "busy" in r[2]["error"]["message"] for r in refused)
        assert all(r[2]["choices"][0]["finish_reason"] == "length" for r in ok)
        assert metric(srv.url, "octavo:requests_rejected_total") == len(refused)
        assert time.time() - started < 120

        # SIGTERM while a request runs: it completes, then the process exits 0.
        holder: list = []
        t = threading.Thread(target=lambda: holder.append(httpx.post(
            srv.url + "/v1/completions", timeout=120,
            json={"prompt": "Tell a story", "max_tokens": 60, "ignore_eos": True})))
        t.start()
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert holder and holder[0].status_code == 200
        assert holder[0].json()["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
    finally:
        srv.stop()


def test_engine_death_gives_503_and_nonzero_exit(smollm_gguf, tmp_path):
    srv = start_server(smollm_gguf, tmp_path)
    try:
        children = child_pids(srv.proc.pid)
        assert children, "no engine-core process found"
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        health, completion = set(), set()
        deadline = time.time() + 10
        while time.time() < deadline and srv.proc.poll() is None:
            try:
                health.add(httpx.get(srv.url + "/health", timeout=1).status_code)
                completion.add(httpx.post(srv.url + "/v1/completions", json={"prompt": "x"},
                                          timeout=5).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert 503 in health and 500 in completion, (health, completion)
        assert srv.proc.wait(30) != 0
    finally:
        srv.stop()


def test_bad_model_stops_the_early_core_and_names_the_model(tmp_path):
    """The core process starts before the front end has read the model: when that fails, the
    core is stopped and the command exits 2 with the reason."""
    import subprocess
    import sys

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "serve",
                           "--model", str(junk), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "junk.gguf: not a valid GGUF file" in done.stderr
    assert time.time() - start < 60


def test_bad_flag_after_the_core_started_stops_it(tmp_path):
    """`octavo serve` launches the core right after parsing its arguments; a flag checked later
    (an unknown tool-call parser) stops the core, removes its socket folder and exits 2."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "serve",
                           "--port", "0", "--enable-auto-tool-choice",
                           "--tool-call-parser", "no-such-parser"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no-such-parser" in done.stderr
    assert not list(tmp_path.glob("octavo-*")), "the core's socket folder was left behind"
