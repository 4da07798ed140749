"""`octavo serve --tensor-parallel-size 2` (the mp executor) on the tiny random Llama: a worker
process killed mid-request fails the request with an error naming the rank within 5 s, and one
killed while the server is idle turns /health to 503 within seconds; either way the server exits
non-zero and leaves no process."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.e2e.conftest import SERVED_NAME, start_server
from tests.executor.procs import alive, descendants

FAILURE_BOUND_S = 5.0
EXIT_BOUND_S = 30.0  # the server's own exit after its engine died (grace for /health, teardown)


def _serve(model, tmp_path):
    return start_server(model, tmp_path, "--max-model-len", "256", "--kv-cache-memory", "8MiB",
                        "--tensor-parallel-size", "2", "--num-threads", "1",
                        "--native-kernels", "off")


def _workers(server_pid: int) -> list[int]:
    pids = []
    for pid in sorted(descendants(server_pid)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"octavo.executor.mp_worker" in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return pids


def _health_503_within(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 503:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def _exits_leaving_nothing(srv, below: set[int]) -> None:
    assert srv.proc.wait(EXIT_BOUND_S) != 0, srv.log()[-3000:]
    deadline = time.monotonic() + EXIT_BOUND_S
    while any(alive(p) for p in below):
        assert time.monotonic() < deadline, [p for p in below if alive(p)]
        time.sleep(0.05)


def test_a_worker_killed_mid_request_fails_it_within_seconds(tiny_llama, tmp_path):
    srv = _serve(tiny_llama, tmp_path)
    try:
        below = descendants(srv.proc.pid)
        workers = _workers(srv.proc.pid)
        assert len(workers) == 2
        events, done = [], threading.Event()

        def stream() -> None:
            body = {"model": SERVED_NAME, "prompt": "hello there", "max_tokens": 200,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                                  timeout=60) as response:
                    events.append(response.status_code)
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
            except httpx.HTTPError as exc:
                events.append(exc)
            done.set()

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 60
        while len(events) < 4:  # the status and a few tokens: the request is running
            assert time.monotonic() < deadline and not done.is_set(), events
            time.sleep(0.01)
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        assert done.wait(FAILURE_BOUND_S), "the request did not end"
        thread.join()
        assert time.monotonic() - killed < FAILURE_BOUND_S
        last = events[-1]
        assert isinstance(last, dict), events[-3:]
        text = json.dumps(last)
        assert "worker rank 1" in text and "died" in text, last
        assert _health_503_within(srv.url, FAILURE_BOUND_S)
        _exits_leaving_nothing(srv, below)
    finally:
        srv.stop()


def test_a_worker_killed_while_idle_turns_health_to_503(tiny_llama, tmp_path):
    srv = _serve(tiny_llama, tmp_path)
    try:
        below = descendants(srv.proc.pid)
        workers = _workers(srv.proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert _health_503_within(srv.url, FAILURE_BOUND_S)
        _exits_leaving_nothing(srv, below)
        assert "worker rank 0" in srv.log()
    finally:
        srv.stop()
