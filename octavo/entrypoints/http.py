"""The HTTP app: state, authentication, body limits, CORS, errors, /health, /metrics, /version.

The OpenAI and Anthropic routers are mounted on it. Errors always have OpenAI's body
`{"error": {"message", "type", "param", "code"}}` (Anthropic's shape on its own routes).
"""
from __future__ import annotations

import asyncio
import hmac
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
from octavo.serving.chat_output import ChatParsers

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
    on_engine_death: Callable[[], None] = lambda: None
    tasks: list[asyncio.Task] = field(default_factory=list)


class APIError(Exception):
    """An error answered with an HTTP status and a message that names the problem."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _ERROR_TYPES.get(status, "BadRequestError")


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   kind: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):
        body = {"type": "error", "error": {
            "type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": kind or _ERROR_TYPES.get(status, "Error"),
                          "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


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
    if model is None or model in state.served_model_names:
        return state.served_model_names[0]
    raise APIError(404, f"The model `{model}` does not exist; this server serves "
                        f"{', '.join(state.served_model_names)}", "model")


_OPEN_PATHS = {"/health", "/version", "/metrics"}


def build_app(state: ServerState, allowed_origins: list[str] | None = None) -> FastAPI:
    from octavo.entrypoints.anthropic.api import router as anthropic_router
    from octavo.entrypoints.openai.api import router as openai_router

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start_background()
        loop = asyncio.get_running_loop()
        state.tasks.append(loop.create_task(_log_stats(state)))
        state.tasks.append(loop.create_task(_watch_engine(state)))
        yield
        for task in state.tasks:
            task.cancel()
        await state.engine.shutdown()

    app = FastAPI(title="octavo", version=octavo.__version__, lifespan=lifespan)
    app.state.server = state
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=True)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_request_bytes:
            return error_response(request, 413, f"request body of {length} bytes exceeds "
                                  f"max_request_bytes ({state.max_request_bytes})")
        if state.api_key and request.url.path not in _OPEN_PATHS and request.method != "OPTIONS":
            if not _authorized(request, state.api_key):
                return error_response(request, 401, "missing or wrong API key")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param, exc.kind)

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
        if state.engine.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": octavo.__version__}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        if not await state.engine.call_utility("reset_prefix_cache"):
            return error_response(request, 409, "the prefix cache cannot be reset while "
                                  "requests are running", kind="ConflictError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_router)
    app.include_router(anthropic_router)
    return app


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


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


async def unless_disconnected(request: Request, work: Awaitable):
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
