"""The request log and the tracer on a stand-in ASGI app (no model): access lines, request and
output logging, JSON and streamed replies, faults, spans with vLLM's attribute names."""
from __future__ import annotations

import asyncio
import json
import logging
import sys

import httpx
import pytest

from octavo.entrypoints.request_log import RequestLog, RequestLogConfig

CHAT = {"id": "chatcmpl-abc", "object": "chat.completion", "model": "smol",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def _chunk(**choice) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-s", "model": "smol",
                                  "choices": [{"index": 0, **choice}]}) + "\n\n"


async def stand_in(scope, receive, send):
    """JSON for a plain chat body, server-sent events for stream=true, a fault on /boom."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/boom":
        raise RuntimeError("boom")
    request = json.loads(body) if body else {}
    if isinstance(request, dict) and request.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        events = [_chunk(delta={"role": "assistant", "content": ""}),
                  _chunk(delta={"content": "Hi"}),
                  _chunk(delta={"content": " you"}, finish_reason="length"),
                  "data: " + json.dumps({"id": "chatcmpl-s", "choices": [],
                                         "usage": usage}) + "\n\n", "data: [DONE]\n\n"]
        for event in events:  # split mid-line: the reader must join them
            half = len(event) // 2
            for part in (event[:half], event[half:]):
                await asyncio.sleep(0.01)
                await send({"type": "http.response.body", "body": part.encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    payload = json.dumps(CHAT).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def call(config: RequestLogConfig, path: str, body: dict | None = None, tracer=None,
         headers: dict | None = None) -> httpx.Response:
    app = RequestLog(stand_in, config, tracer)

    async def go():
        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 4321),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body, headers=headers or {})

    return asyncio.run(go())


def test_access_line_of_a_json_reply(caplog):
    caplog.set_level(logging.INFO)
    r = call(RequestLogConfig(), "/v1/chat/completions", {"messages": []})
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-")
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "octavo.access"]
    assert line.startswith('10.0.0.9:4321 "POST /v1/chat/completions" 200 prompt_tokens=5 '
                           'completion_tokens=7 latency_ms=')
    assert line.endswith(f"request_id={rid} id=chatcmpl-abc")
    # by default nothing else: no prompts, no outputs
    assert [rec for rec in caplog.records
            if rec.name.startswith("octavo") and rec.name != "octavo.access"] == []


def test_client_request_id_kept_only_when_well_formed(caplog):
    caplog.set_level(logging.INFO)
    r = call(RequestLogConfig(), "/v1/chat/completions", {"messages": []},
             headers={"X-Request-Id": "trace-42.a"})
    assert r.headers["x-request-id"] == "trace-42.a"
    r = call(RequestLogConfig(), "/v1/chat/completions", {"messages": []},
             headers={"X-Request-Id": "a b\tc"})
    assert r.headers["x-request-id"].startswith("req-")


def test_no_access_line_when_disabled(caplog):
    caplog.set_level(logging.INFO)
    call(RequestLogConfig(access_log=False), "/v1/chat/completions", {"messages": []})
    assert not [rec for rec in caplog.records if rec.name == "octavo.access"]


def test_requests_and_outputs_logged_and_cut(caplog):
    caplog.set_level(logging.INFO)
    config = RequestLogConfig(log_requests=True, log_outputs=True, max_log_len=12)
    call(config, "/v1/completions", {"prompt": "once upon a time in a land far away",
                                     "max_tokens": 9, "temperature": 0.5, "stream": True})
    received, generated = [rec.getMessage() for rec in caplog.records
                           if rec.name == "octavo.entrypoints.request_log"]
    assert received.startswith("Received request req-")
    assert "prompt: 'once upon a '... (23 more characters)" in received
    assert "more characters)" in received
    assert '"max_tokens": 9' in received and "once upon" not in received.split("params")[1]
    assert "Generated response req-" in generated and "(chatcmpl-s)" in generated
    assert "output: 'Hi you'" in generated and "finish_reason: length" in generated
    [access] = [rec.getMessage() for rec in caplog.records if rec.name == "octavo.access"]
    assert "prompt_tokens=3 completion_tokens=2" in access


def test_a_fault_is_logged_as_500(caplog):
    caplog.set_level(logging.INFO)
    r = call(RequestLogConfig(), "/boom", {"x": 1})
    assert r.status_code == 500
    [access] = [rec.getMessage() for rec in caplog.records if rec.name == "octavo.access"]
    assert '"POST /boom" 500 prompt_tokens=- completion_tokens=-' in access


def test_control_characters_in_the_path_are_escaped(caplog):
    caplog.set_level(logging.INFO)
    call(RequestLogConfig(), "/v1/x%0Afake%20line", {})
    [access] = [rec.getMessage() for rec in caplog.records if rec.name == "octavo.access"]
    assert "\n" not in access and "/v1/x\\nfake line" in access


# -- tracing ------------------------------------------------------------------------------------

def _memory_tracer():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from octavo.entrypoints.tracing import Tracer

    exporter = InMemorySpanExporter()
    return Tracer(exporter=exporter), exporter


def test_span_of_a_streamed_request():
    tracer, exporter = _memory_tracer()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    call(RequestLogConfig(), "/v1/chat/completions",
         {"messages": [], "max_tokens": 9, "temperature": 0.25, "top_p": 0.5, "n": 1,
          "stream": True}, tracer, headers={"traceparent": parent})
    [span] = exporter.get_finished_spans()
    a = span.attributes
    assert span.name == "llm_request"
    assert a["gen_ai.request.id"] == "chatcmpl-s"
    assert a["gen_ai.response.model"] == "smol"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.request.top_p"], a["gen_ai.request.n"]) == (9, 0.25, 0.5, 1)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (3, 2)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    # the first text came after the role chunk and before the end
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    assert a["http.response.status_code"] == 200
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    tracer.shutdown()


def test_span_of_a_whole_reply_has_no_first_token_time():
    tracer, exporter = _memory_tracer()
    call(RequestLogConfig(), "/v1/chat/completions", {"messages": [], "max_tokens": [1]},
         tracer)
    [span] = exporter.get_finished_spans()
    assert span.attributes["gen_ai.usage.completion_tokens"] == 7
    assert "gen_ai.latency.time_to_first_token" not in span.attributes
    assert "gen_ai.request.max_tokens" not in span.attributes  # not a number: left out
    assert span.parent is None


def test_only_generation_routes_are_traced():
    tracer, exporter = _memory_tracer()
    call(RequestLogConfig(), "/tokenize", {"prompt": "x"}, tracer)
    assert exporter.get_finished_spans() == ()


def test_tracing_without_the_extra_names_it(monkeypatch):
    from octavo.entrypoints.tracing import Tracer

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'octavo\[otlp\]'"):
        Tracer("http://127.0.0.1:4317")


def test_anthropic_and_responses_replies_are_read():
    from octavo.entrypoints.request_log import Exchange

    streamed = Exchange("r", "POST", "/v1/messages", "-", {}, stream=True)
    for event in ({"type": "message_start", "message": {
                      "id": "msg_1", "model": "smol", "content": [],
                      "usage": {"input_tokens": 9, "output_tokens": 0}}},
                  {"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "Hel"}},
                  {"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "lo"}},
                  {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": 2}}):
        streamed.absorb(event, keep_text=True)
    assert (streamed.response_id, streamed.prompt_tokens, streamed.completion_tokens) == \
        ("msg_1", 9, 2)
    assert streamed.texts == {0: "Hello"} and streamed.finish_reasons == {0: "end_turn"}

    whole = Exchange("r", "POST", "/v1/responses", "-", {})
    whole.absorb({"id": "resp_1", "object": "response", "status": "completed", "model": "smol",
                  "output": [{"type": "message", "content": [
                      {"type": "output_text", "text": "Hi there"}]}],
                  "usage": {"input_tokens": 4, "output_tokens": 2}}, keep_text=True)
    assert (whole.response_id, whole.prompt_tokens, whole.completion_tokens) == \
        ("resp_1", 4, 2)
    assert whole.texts == {0: "Hi there"}

    events = Exchange("r", "POST", "/v1/responses", "-", {}, stream=True)
    for event in ({"type": "response.created", "response": {"id": "resp_2", "model": "smol",
                                                             "usage": None}},
                  {"type": "response.output_text.delta", "delta": "Yo"},
                  {"type": "response.completed", "response": {
                      "id": "resp_2", "object": "response", "output": [
                          {"type": "message", "content": [{"type": "output_text",
                                                           "text": "Yo"}]}],
                      "usage": {"input_tokens": 3, "output_tokens": 1}}}):
        events.absorb(event, keep_text=True)
    assert (events.response_id, events.prompt_tokens, events.completion_tokens) == \
        ("resp_2", 3, 1)
    assert events.texts == {0: "Yo"} and events.first_token is not None


def test_bodies_that_are_not_json_objects_are_still_served(caplog):
    caplog.set_level(logging.INFO)
    config = RequestLogConfig(log_requests=True)
    app = RequestLog(stand_in, config)

    async def go(content: bytes):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", content=content)

    assert asyncio.run(go(b"[" * 200000)).status_code == 500  # the stand-in cannot parse it
    assert asyncio.run(go(b"[1, 2]")).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("request_log")]
    assert lines[0].endswith("a body of 200000 bytes that is not a JSON object")
    assert lines[1].endswith("a body of 6 bytes that is not a JSON object")
