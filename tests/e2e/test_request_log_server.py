"""The request log and the OTLP traces of a real server: the lines its log holds for whole,
streamed and refused requests, one access line each; spans received by a local OTLP/HTTP
collector with vLLM's attribute names; a missing extra fails the start with the pip extra."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.e2e.conftest import start_server

KEY = "log-key"


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "octavo.access:" in line]


def test_request_and_output_logging(smollm_gguf, tmp_path):
    server = start_server(smollm_gguf, tmp_path, "--api-key", KEY, "--enable-log-requests",
                          "--enable-log-outputs", "--max-log-len", "20")
    try:
        prompt = "A long prompt that the log must cut short, " * 3
        whole = httpx.post(server.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {KEY}",
                                    "X-Request-Id": "client-id-1"},
                           json={"model": "smol", "prompt": prompt, "max_tokens": 6,
                                 "temperature": 0})
        assert whole.status_code == 200 and whole.headers["x-request-id"] == "client-id-1"
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "Say hi"}],
                                "max_tokens": 5, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            streamed_id = r.headers["x-request-id"]
            body = r.read().decode()
        refused = _post(server, "/v1/completions", {"prompt": "x"}, key=None)
        assert refused.status_code == 401
        time.sleep(0.5)
    finally:
        server.stop()
    log = server.log()
    usage = whole.json()["usage"]
    text = whole.json()["choices"][0]["text"]
    access = _access_lines(log)
    [line] = [a for a in access if "request_id=client-id-1" in a]
    assert re.search(r'"POST /v1/completions" 200 prompt_tokens=%d completion_tokens=6 '
                     r'latency_ms=[\d.]+ request_id=client-id-1 id=cmpl-' %
                     usage["prompt_tokens"], line), line
    [line] = [a for a in access if f"request_id={streamed_id}" in a]
    assert '"POST /v1/chat/completions" 200 prompt_tokens=' in line
    assert "completion_tokens=5" in line and " id=chatcmpl-" in line
    assert any('"POST /v1/completions" 401 prompt_tokens=- completion_tokens=-' in a
               for a in access)
    # one line per request: the three above and the health checks, uvicorn's own off
    assert not re.search(r'"(POST|GET) /\S* HTTP/1\.1" \d{3}', log)
    assert len([a for a in access if '"POST' in a]) == 3
    assert ("Received request client-id-1: /v1/completions, prompt: 'A long prompt that "
            f"t'... ({len(prompt) - 20} more characters)") in log
    assert '"max_tokens": 6' in log
    assert "Generated response client-id-1 (cmpl-" in log
    assert f"output: {repr(text[:20])}" in log
    streamed_text = "".join(re.findall(r'"content": "([^"]*)"', body))
    assert f"Generated response {streamed_id} (chatcmpl-" in log
    assert f"output: {repr(streamed_text[:20])}" in log
    assert "(no id)" not in log  # the refused request generated nothing


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace collector: keeps every ExportTraceServiceRequest it is sent."""

    received: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        _Collector.received.append(self.rfile.read(length))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _spans() -> list:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    spans = []
    for raw in _Collector.received:
        request = ExportTraceServiceRequest.FromString(raw)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
    return spans


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_otlp_spans_reach_a_collector(smollm_gguf, tmp_path, monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    _Collector.received.clear()
    server = start_server(smollm_gguf, tmp_path, "--otlp-traces-endpoint", endpoint,
                          "--disable-access-log")
    try:
        r = _post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0.0, "top_p": 0.9}, key=None)
        assert r.status_code == 200
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "prompt": "Once", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}) as s:
            s.read()
        assert _post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 200
    finally:
        server.stop()  # the shutdown flushes the spans still queued
        collector.shutdown()
    spans = {(_attributes(s)["gen_ai.request.id"]): s for s in _spans()}
    assert len(spans) == 2  # generation requests only
    chat = _attributes(spans[r.json()["id"]])
    assert spans[r.json()["id"]].name == "llm_request"
    assert chat["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert chat["gen_ai.usage.completion_tokens"] == 4
    assert chat["gen_ai.request.max_tokens"] == 4
    assert chat["gen_ai.request.temperature"] == 0.0 and chat["gen_ai.request.top_p"] == 0.9
    assert chat["gen_ai.latency.e2e"] > 0
    [streamed] = [_attributes(s) for k, s in spans.items() if k.startswith("cmpl-")]
    assert streamed["gen_ai.usage.completion_tokens"] == 3
    assert 0 < streamed["gen_ai.latency.time_to_first_token"] <= streamed["gen_ai.latency.e2e"]
    assert not _access_lines(server.log())  # --disable-access-log


def test_otlp_flag_without_the_extra_fails_at_start(tmp_path):
    code = ("import sys; sys.modules['opentelemetry.sdk.trace'] = None; "
            "from octavo.entrypoints.cli.main import main; "
            "sys.exit(main(['serve', '--otlp-traces-endpoint', 'http://127.0.0.1:4317']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "pip install 'octavo[otlp]'" in done.stderr
