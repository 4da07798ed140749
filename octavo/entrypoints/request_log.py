"""What the server logs about each request, read at the HTTP door (an ASGI layer outside the
guard, so refused requests are logged too).

- An access line per request, on by default (`--disable-access-log` turns it off): client,
  method, path, status, prompt and completion tokens where the response says them, latency and
  the request id (`X-Request-Id` when the client sends a well-formed one, else a new one; the
  response carries it back in the same header).
- With `--enable-log-requests`: a generation request's prompt (or messages) and its sampling
  fields as they arrive; with `--enable-log-outputs`: the generated text once the reply is
  done. Both cut to `--max-log-len` characters.
- With a tracer (`--otlp-traces-endpoint`, see `tracing.py`): the finished `Exchange`.

Responses are read as they pass, never held back: JSON bodies are parsed once they are complete,
server-sent events one event at a time (every event only when outputs are logged or traced;
otherwise the first, for the reply's id, and those that carry usage).
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from octavo.entrypoints.guard import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("octavo.access")

# The routes that generate: their bodies are read for logging and tracing.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages",
                              "/v1/responses"})
_CONTENT_FIELDS = ("prompt", "messages", "input", "instructions", "system", "tools")
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_MAX_PATH_CHARS = 200
MAX_REPLY_BYTES = 32 << 20  # a whole JSON reply beyond this is not read for its usage


@dataclass(frozen=True)
class RequestLogConfig:
    access_log: bool = True
    log_requests: bool = False  # --enable-log-requests
    log_outputs: bool = False  # --enable-log-outputs
    max_log_len: int | None = None  # characters of a prompt or output logged; None: all
    max_body_bytes: int = 8 << 20  # a request body beyond this is not read for logging

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")


class ExchangeSink(Protocol):
    """Receives each finished generation exchange (the tracer)."""

    def record(self, exchange: Exchange) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class Exchange:
    """What one request and its response showed at the door."""

    request_id: str
    method: str
    path: str
    client: str
    headers: dict[str, str]
    start_ns: int = field(default_factory=time.time_ns)  # wall clock, for spans
    start: float = field(default_factory=time.perf_counter)
    body: dict | None = None  # the request's JSON object (generation routes)
    status: int | None = None
    stream: bool = False  # the reply is server-sent events
    json: bool = False  # the reply is one JSON document
    response_id: str | None = None  # the reply's own id (chatcmpl-..., msg_...)
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token: float | None = None  # perf_counter of the first generated text (streams)
    end: float | None = None
    texts: dict[int, str] = field(default_factory=dict)  # per choice (only when kept)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def latency_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def generation(self) -> bool:
        return self.method == "POST" and self.path in GENERATION_PATHS

    def absorb(self, obj: Any, keep_text: bool) -> None:
        """Take what a response object (a whole body or one streamed event) says."""
        if not isinstance(obj, dict):
            return
        # Anthropic's message_start and the Responses API's events wrap the reply's fields.
        message = obj.get("message") if obj.get("type") == "message_start" else None
        if message is None and isinstance(obj.get("response"), dict):
            message = obj["response"]
        source = message if isinstance(message, dict) else obj
        if self.response_id is None and isinstance(source.get("id"), str):
            self.response_id = source["id"]
        if self.model is None and isinstance(source.get("model"), str):
            self.model = source["model"]
        usage = source.get("usage")
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if isinstance(prompt, int):
                self.prompt_tokens = prompt
            if isinstance(completion, int) and not (self.stream and obj.get("type") ==
                                                    "message_start"):
                self.completion_tokens = completion  # message_start's 0 is no count yet
        for index, text, reason in _pieces(obj):  # a wrapped reply repeats the text
            if text and self.first_token is None:
                self.first_token = time.perf_counter()
            if text and keep_text:
                self.texts[index] = self.texts.get(index, "") + text
            if reason:
                self.finish_reasons[index] = reason


def _pieces(obj: dict) -> list[tuple[int, str, str | None]]:
    """(choice index, text, finish reason) of an OpenAI or Anthropic body or event."""
    out = []
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        part = choice.get("delta") or choice.get("message") or {}
        text = choice.get("text") if "text" in choice else part.get("content")
        out.append((choice.get("index", 0), text if isinstance(text, str) else "",
                    choice.get("finish_reason")))
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        text = delta.get("text", delta.get("partial_json", delta.get("thinking", "")))
        out.append((0, text if isinstance(text, str) else "", None))
    elif kind == "message" and isinstance(obj.get("content"), list):
        text = "".join(b.get("text", "") for b in obj["content"]
                       if isinstance(b, dict) and isinstance(b.get("text"), str))
        out.append((0, text, obj.get("stop_reason")))
    elif kind == "message_delta":
        out.append((0, "", (obj.get("delta") or {}).get("stop_reason")))
    elif kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
        out.append((0, obj["delta"], None))
    elif obj.get("object") == "response" and isinstance(obj.get("output"), list):
        text = "".join(part.get("text", "") for item in obj["output"] if isinstance(item, dict)
                       for part in item.get("content") or () if isinstance(part, dict)
                       and isinstance(part.get("text"), str))
        out.append((0, text, obj.get("status")))
    return out


class _ResponseReader:
    """Reads a response body as it passes: a JSON document, or server-sent events."""

    def __init__(self, exchange: Exchange, every_event: bool, keep_text: bool) -> None:
        self.exchange = exchange
        self.every_event = every_event
        self.keep_text = keep_text
        self.buffer = bytearray()
        self.overflow = False
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        if self.overflow or not (self.exchange.stream or self.exchange.json):
            return
        self.buffer += chunk
        if self.exchange.stream:
            *lines, rest = self.buffer.split(b"\n")
            self.buffer = bytearray(rest)
            for line in lines:
                self._line(bytes(line))
        if len(self.buffer) > MAX_REPLY_BYTES:  # an event that long is not one of ours either
            self.overflow, self.buffer = True, bytearray()

    def close(self) -> None:
        if self.exchange.stream:
            self._line(bytes(self.buffer))
        elif self.buffer and not self.overflow:
            try:
                self.exchange.absorb(json.loads(self.buffer), self.keep_text)
            except (ValueError, RecursionError):
                pass  # declared JSON and is not: nothing to read
        self.buffer = bytearray()

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        self.events += 1
        if not (self.every_event or self.events == 1 or b'"usage": {' in payload
                or b'"usage":{' in payload):
            return
        try:
            self.exchange.absorb(json.loads(payload), self.keep_text)
        except (ValueError, RecursionError):
            pass


class RequestLog:
    """The ASGI layer that observes every request (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: RequestLogConfig,
                 tracer: ExchangeSink | None = None) -> None:
        self.app = app
        self.config = config
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        given = headers.get("x-request-id", "")
        client = scope.get("client")
        exchange = Exchange(
            given if _CLIENT_ID.fullmatch(given) else f"req-{secrets.token_hex(8)}",
            scope.get("method", ""), scope.get("path", ""),
            f"{client[0]}:{client[1]}" if client else "-", headers)
        config = self.config
        read_body = exchange.generation and (config.log_requests or self.tracer is not None)
        keep_text = config.log_outputs and exchange.generation
        reader = _ResponseReader(exchange, keep_text or self.tracer is not None, keep_text)
        chunks: list[bytes] = []
        size, received = 0, not read_body

        async def observed_receive() -> Message:
            nonlocal size, received
            message = await receive()
            if not received and message["type"] == "http.request":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= config.max_body_bytes:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    received = True
                    try:
                        self._received(exchange, b"".join(chunks), size)
                    except Exception:  # a logging fault must not fail the request
                        logger.exception("logging request %s failed", exchange.request_id)
                    chunks.clear()
            return message

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                raw = list(message.get("headers", ()))
                kind = next((v for k, v in raw if k.lower() == b"content-type"), b"")
                exchange.stream = kind.startswith(b"text/event-stream")
                exchange.json = kind.startswith(b"application/json")
                raw.append((b"x-request-id", exchange.request_id.encode()))
                message = {**message, "headers": raw}
            elif message["type"] == "http.response.body":
                reader.feed(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, observed_receive, observed_send)
        except BaseException:
            if exchange.status is None:
                exchange.status = 500
            raise
        finally:
            reader.close()
            exchange.end = time.perf_counter()
            self._finished(exchange)

    def _received(self, exchange: Exchange, raw: bytes, size: int) -> None:
        if size > self.config.max_body_bytes:
            body = None
        else:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # the route answers it with a 400
                body = None
        exchange.body = body if isinstance(body, dict) else None
        if not self.config.log_requests:
            return
        if exchange.body is None:
            logger.info("Received request %s: %s %s, a body of %d bytes that is not a JSON "
                        "object", exchange.request_id, exchange.method, _clean(exchange.path),
                        size)
            return
        content = {k: exchange.body[k] for k in _CONTENT_FIELDS if k in exchange.body}
        params = {k: v for k, v in exchange.body.items() if k not in _CONTENT_FIELDS}
        prompt = content.get("prompt", content.get("messages", content.get("input")))
        logger.info("Received request %s: %s, prompt: %s, params: %s", exchange.request_id,
                    _clean(exchange.path), self._shown(prompt),
                    json.dumps(params, ensure_ascii=False))

    def _finished(self, exchange: Exchange) -> None:
        if self.config.access_log:
            access_logger.info(
                '%s "%s %s" %s prompt_tokens=%s completion_tokens=%s latency_ms=%.1f '
                'request_id=%s%s', exchange.client, exchange.method, _clean(exchange.path),
                exchange.status, _or_dash(exchange.prompt_tokens),
                _or_dash(exchange.completion_tokens), 1000 * exchange.latency_s,
                exchange.request_id,
                f" id={exchange.response_id}" if exchange.response_id else "")
        if self.config.log_outputs and exchange.generation and exchange.status == 200:
            logger.info("Generated response %s (%s): output: %s, finish_reason: %s",
                        exchange.request_id, exchange.response_id or "no id",
                        self._shown(exchange.texts.get(0, "") if len(exchange.texts) < 2
                                    else exchange.texts),
                        ",".join(str(exchange.finish_reasons[i])
                                 for i in sorted(exchange.finish_reasons)) or None)
        if self.tracer is not None and exchange.generation:
            try:
                self.tracer.record(exchange)
            except Exception:  # a tracing fault must not fail the request it describes
                logger.exception("recording the trace span of %s failed", exchange.request_id)

    def _shown(self, value: Any) -> str:
        """A prompt or output as one log-safe line (newlines and control characters escaped),
        cut to --max-log-len characters of the text (of the JSON for messages)."""
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        limit = self.config.max_log_len
        more = "" if limit is None or len(text) <= limit else \
            f"... ({len(text) - limit} more characters)"
        if more:
            text = text[:limit]
        return (repr(text) if isinstance(value, str) else text) + more


def _clean(path: str) -> str:
    return path[:_MAX_PATH_CHARS].encode("unicode_escape").decode("ascii")


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
