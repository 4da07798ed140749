"""The HTTP app: state, CORS, errors, /health, /metrics, /version, request timeouts; keys,
hosts and body limits are checked by `guard.Guard` in front of it, and `request_log.RequestLog`
in front of that logs (and traces) every request.

The OpenAI and Anthropic routers are mounted on it. Errors always have OpenAI's body
`{"error": {"message", "type", "param", "code"}}` (Anthropic's shape on its own routes).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import octavo
from octavo.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from octavo.entrypoints.guard import Guard, GuardPolicy
from octavo.entrypoints.openai.responses_store import ResponseStore
from octavo.entrypoints.request_log import ExchangeSink, RequestLog, RequestLogConfig
from octavo.params import LoRARequest
from octavo.serving.chat_output import ChatParsers
from octavo.serving.chat_template import RenderLimits

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0
ENGINE_DEATH_GRACE_S = 2.0  # health checks see 503 before the process exits


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    parsers: ChatParsers = field(default_factory=ChatParsers)  # tool-call and reasoning parsers
    max_request_bytes: int = 8 << 20
    admin_api_key: str | None = None  # guards the admin routes (else api_key does)
    metrics_require_key: bool = False
    allowed_hosts: frozenset[str] | None = None  # Host header allow-list; None: any
    trust_request_chat_template: bool = False  # may a request bring its own chat template
    request_timeout_s: float | None = None  # a request still running after this is aborted
    request_log: RequestLogConfig = field(default_factory=RequestLogConfig)
    tracer: ExchangeSink | None = None  # --otlp-traces-endpoint
    on_engine_death: Callable[[], None] = lambda: None
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses
    # LoRA adapters loaded and unloaded over HTTP (admin routes), from under lora_root only
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    grpc_address: tuple[str, int] | None = None  # --host and --grpc-port: gRPC beside HTTP
    grpc_max_calls: int | None = None  # concurrent gRPC calls (--max-concurrent-connections)
    shutdown_grace_s: float | None = None  # running gRPC calls' time to finish on shutdown

    @property
    def render_limits(self) -> RenderLimits:
        """A chat render's budget: the preprocess timeout, and a few times the largest body
        in characters (a template wraps the messages; it does not multiply them)."""
        return RenderLimits(self.engine.limits.preprocess_timeout_s,
                            4 * self.max_request_bytes + (64 << 10))

    def guard_policy(self) -> GuardPolicy:
        return GuardPolicy(self.api_key, self.admin_api_key, self.max_request_bytes,
                           self.allowed_hosts, self.metrics_require_key)


class APIError(Exception):
    """An error answered with an HTTP status and a message that names the problem."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None, usage: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _ERROR_TYPES.get(status, "BadRequestError")
        self.usage = usage  # a timed-out request's partial usage


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 429: "RateLimitError", 431: "HeadersTooLargeError",
                500: "InternalServerError", 503: "ServiceUnavailableError",
                504: "TimeoutError"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(path: str, status: int, message: str, param: str | None = None,
               kind: str | None = None, usage: dict | None = None) -> dict:
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {
            "type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": kind or _ERROR_TYPES.get(status, "Error"),
                          "param": param, "code": status}}
    if usage is not None:
        body["usage"] = usage
    return body


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   kind: str | None = None, headers: dict[str, str] | None = None,
                   usage: dict | None = None) -> JSONResponse:
    return _ErrorResponse(error_body(request.url.path, status, message, param, kind, usage),
                          status_code=status, headers=headers)


class _ErrorResponse(JSONResponse):
    """ASCII JSON: an error may quote what the client sent, lone surrogates included, which
    UTF-8 cannot carry."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


async def _send_error(scope, receive, send, status: int, message: str) -> None:
    await _ErrorResponse(error_body(scope["path"], status, message),
                         status_code=status)(scope, receive, send)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        first_param = first_param or name
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown parameter '{name}'")
        elif err.get("type") == "missing":
            parts.append(f"'{name}' is required")
        elif err.get("type") == "json_invalid":
            parts.append("the body is not valid JSON")
        else:
            parts.append(f"'{name}': {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", first_param


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, model: str | None) -> str:
    """The name a response reports: the base model's first name, or the adapter's."""
    if model is None or model in state.served_model_names:
        return state.served_model_names[0]
    if model in state.engine.processor.adapters.named:
        return model
    names = [*state.served_model_names, *state.engine.processor.adapters.named]
    raise APIError(404, f"The model `{model}` does not exist; this server serves "
                        f"{', '.join(names)}", "model")


async def detokenize_ids(state: ServerState, ids: list[int], field: str,
                         skip_special_tokens: bool = False) -> str:
    """The text of token ids (/detokenize, gRPC's Detokenize), off the event loop; an id
    outside the vocabulary is a 400 naming `field`."""
    vocab = state.engine.processor.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})", field)
    return await state.engine.offload.run("detokenizing", state.engine.tokenizer.decode, ids,
                                          skip_special_tokens)


def adapter_of(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter the request's `model` names (None: the base model)."""
    return None if model is None else state.engine.processor.adapters.named.get(model)


def build_app(state: ServerState, allowed_origins: list[str] | None = None) -> FastAPI:
    from octavo.entrypoints.anthropic.api import router as anthropic_router
    from octavo.entrypoints.openai.api import router as openai_router
    from octavo.entrypoints.openai.embeddings import router as embeddings_router
    from octavo.entrypoints.openai.scores import router as scores_router
    from octavo.entrypoints.openai.lora import router as lora_router
    from octavo.entrypoints.openai.responses import router as responses_router

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start_background()
        loop = asyncio.get_running_loop()
        state.tasks.append(loop.create_task(_log_stats(state)))
        state.tasks.append(loop.create_task(_watch_engine(state)))
        grpc_server = None
        if state.grpc_address is not None:
            from octavo.entrypoints.grpc.server import start_grpc_server

            grpc_server = await start_grpc_server(state, *state.grpc_address,
                                                  state.grpc_max_calls)
        yield
        if grpc_server is not None:
            await grpc_server.stop(state.shutdown_grace_s)
        for task in state.tasks:
            task.cancel()
        await state.engine.shutdown()
        if state.tracer is not None:
            await asyncio.get_running_loop().run_in_executor(None, state.tracer.shutdown)

    app = FastAPI(title="octavo", version=octavo.__version__, lifespan=lifespan)
    app.state.server = state
    # Added first, so it runs inside CORS: a browser's preflight is answered before any key
    # check, and the guard's own errors still carry CORS headers.
    app.add_middleware(Guard, policy=state.guard_policy(), send_error=_send_error)
    if allowed_origins:
        # Credentials are never allowed for any origin ('*'): a page anywhere could then act
        # with the user's cookies or auth headers.
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    # Outermost: the access log sees every request, those the guard refuses too.
    app.add_middleware(RequestLog, config=state.request_log, tracer=state.tracer)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param, exc.kind,
                              usage=exc.usage)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError):
        return error_response(request, 400, str(exc))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError):
        return error_response(request, 429, str(exc),
                              headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(request, 500, f"engine is dead: {exc}")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc)
        return error_response(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> Response:
        if state.engine.dead or state.engine.hung():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": octavo.__version__}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        if not all(await state.engine.call_utility("reset_prefix_cache")):
            return error_response(request, 409, "the prefix cache cannot be reset while "
                                  "requests are running", kind="ConflictError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(scores_router)
    if state.allow_runtime_lora_updating:
        app.include_router(lora_router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    return app


async def _log_stats(state: ServerState) -> None:
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        line = state.engine.metrics.stats_line()
        if line:
            logger.info("%s", line)


async def _watch_engine(state: ServerState) -> None:
    while not state.engine.dead:
        await asyncio.sleep(0.2)
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    state.on_engine_death()


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (its body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable,
                              partial_usage: Callable[[], dict] | None = None):
    """Run `work`; if the client disconnects first, or the server's request timeout passes,
    cancel it (which aborts its requests). A timeout is a 504 with `partial_usage()`."""
    return await bounded(state_of(request), work, partial_usage, until_disconnected(request))


async def bounded(state: ServerState, work: Awaitable,
                  partial_usage: Callable[[], dict] | None = None,
                  disconnected: Awaitable | None = None):
    """Run `work` within the server's request timeout (past it, a 504 with `partial_usage()`),
    and until `disconnected` returns (a 499); either cancels it, which aborts its requests.
    A caller whose protocol cancels the task itself when the client goes (gRPC) passes none."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected if disconnected is not None
                                    else asyncio.Event().wait())
    timeout = state.request_timeout_s
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        if watcher in done:
            raise APIError(499, "client disconnected")
        raise APIError(504, f"the request ran past --request-timeout ({timeout:g} s) and was "
                       f"aborted", usage=partial_usage() if partial_usage else None)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class RequestTimedOut(Exception):
    """A streamed request ran past --request-timeout; its stream ends with an error event."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request ran past --request-timeout ({timeout_s:g} s) and was "
                         f"aborted")


def stream_error(exc: Exception) -> tuple[int, str]:
    """The status and message of the error event that ends a stream already under way: the
    request timed out (RequestTimedOut, from `timed`), or its engine died (EngineDeadError)."""
    if isinstance(exc, EngineDeadError):
        return 500, f"engine is dead: {exc}"
    return 504, str(exc)


# What ends a started stream with an error event in its API's format (see stream_error).
STREAM_ERRORS = (RequestTimedOut, EngineDeadError)


async def timed(state: ServerState, stream: AsyncIterator):
    """`stream`'s items until the request timeout passes (then RequestTimedOut; closing the
    stream aborts its request)."""
    timeout = state.request_timeout_s
    if timeout is None:
        async for item in stream:
            yield item
        return
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                item = await asyncio.wait_for(stream.__anext__(), max(left, 0))
            except StopAsyncIteration:
                return
            except (asyncio.TimeoutError, TimeoutError):
                raise RequestTimedOut(timeout) from None
            yield item
    finally:
        await stream.aclose()
