"""OpenTelemetry traces (`--otlp-traces-endpoint`): one span per generation request, with
vLLM's attribute names, exported over OTLP.

The span is built from what the request log saw at the door (`request_log.Exchange`): the
request's sampling fields, the usage the reply reports, the end-to-end latency and, for streamed
replies, the time to the first generated text (a whole reply's first token is not visible from
outside the engine, so its span has no time_to_first_token). A `traceparent` header the client
sends makes the span a child of the client's trace.

Needs the `otlp` extra (`pip install 'octavo[otlp]'`). The protocol is OpenTelemetry's own
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: grpc (the default, as vLLM) or http/protobuf.
"""
from __future__ import annotations

import os
from typing import Any

from octavo.entrypoints.request_log import Exchange

SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's names (OpenTelemetry's gen_ai conventions, and vLLM's additions)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"


_MISSING_EXTRA = ("--otlp-traces-endpoint needs OpenTelemetry, which is not installed: "
                  "pip install 'octavo[otlp]' (opentelemetry-sdk and "
                  "opentelemetry-exporter-otlp)")


class Tracer:
    """Records finished exchanges as spans; `shutdown` flushes what is still queued."""

    def __init__(self, endpoint: str | None = None, exporter: Any = None) -> None:
        """`exporter`: a span exporter to use instead of OTLP to `endpoint` (tests pass the
        SDK's InMemorySpanExporter)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator)
        except ImportError:
            raise ValueError(_MISSING_EXTRA) from None
        if exporter is None:
            if not endpoint:
                raise ValueError("--otlp-traces-endpoint must be a URL, got an empty value")
            exporter = _otlp_exporter(endpoint)
            processor = BatchSpanProcessor(exporter)
        else:
            processor = SimpleSpanProcessor(exporter)
        import octavo

        self._provider = TracerProvider(resource=Resource.create(
            {"service.name": "octavo", "service.version": octavo.__version__}))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("octavo.entrypoints")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    def record(self, exchange: Exchange) -> None:
        context = self._propagator.extract(exchange.headers)
        end_ns = exchange.start_ns + int(exchange.latency_s * 1e9)
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind,
                                       start_time=exchange.start_ns)
        for name, value in span_attributes(exchange).items():
            span.set_attribute(name, value)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self._provider.shutdown()


def span_attributes(exchange: Exchange) -> dict[str, Any]:
    """The span's attributes; those the exchange did not show are left out."""
    a = SpanAttributes
    body = exchange.body or {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens",
                                                           body.get("max_output_tokens")))
    values: dict[str, Any] = {
        a.GEN_AI_REQUEST_ID: exchange.response_id or exchange.request_id,
        a.GEN_AI_RESPONSE_MODEL: exchange.model,
        a.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        a.GEN_AI_REQUEST_TEMPERATURE: body.get("temperature"),
        a.GEN_AI_REQUEST_TOP_P: body.get("top_p"),
        a.GEN_AI_REQUEST_TOP_K: body.get("top_k"),
        a.GEN_AI_REQUEST_N: body.get("n"),
        a.GEN_AI_USAGE_PROMPT_TOKENS: exchange.prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: exchange.completion_tokens,
        a.GEN_AI_LATENCY_E2E: exchange.latency_s,
        "http.request.method": exchange.method,
        "url.path": exchange.path,
        "http.response.status_code": exchange.status,
        "octavo.request_id": exchange.request_id,
    }
    if exchange.finish_reasons:
        values[a.GEN_AI_RESPONSE_FINISH_REASONS] = [
            str(exchange.finish_reasons[i]) for i in sorted(exchange.finish_reasons)]
        values[a.GEN_AI_USAGE_NUM_SEQUENCES] = len(exchange.finish_reasons)
    if exchange.stream and exchange.first_token is not None:
        values[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = exchange.first_token - exchange.start
    # An attribute is a str, bool, int, float or a list of one of them; anything a client
    # sent of another type (a list of stop strings as max_tokens...) is left out.
    return {k: v for k, v in values.items()
            if isinstance(v, (str, bool, int, float)) or
            (isinstance(v, list) and all(isinstance(x, str) for x in v))}


def _otlp_exporter(endpoint: str) -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or "
                             f"http/protobuf, got {protocol!r}")
    except ImportError:
        raise ValueError(_MISSING_EXTRA) from None
    return OTLPSpanExporter(endpoint=endpoint)
