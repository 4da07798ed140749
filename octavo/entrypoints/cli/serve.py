"""`octavo serve [MODEL]`: the OpenAI- and Anthropic-compatible HTTP server."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from typing import TYPE_CHECKING

from octavo import startup_gc
from octavo.config import DEFAULT_MODEL, EngineConfig, add_engine_args

if TYPE_CHECKING:
    from octavo.entrypoints.http import ServerState

SERVE_MAX_NUM_BATCHED_TOKENS = 512

logger = logging.getLogger(__name__)

_IMPORTED = time.perf_counter()


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"the model (default {DEFAULT_MODEL}); same as --model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="required bearer / x-api-key (default: $OCTAVO_API_KEY, else none)")
    s.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins ('*' = any)")
    s.add_argument("--max-concurrent-connections", type=int, default=None,
                   help="open connections beyond which new ones get 503 (default: no limit)")
    s.add_argument("--admin-api-key", default=None,
                   help="key for the admin routes (/reset_prefix_cache) (default: "
                        "$OCTAVO_ADMIN_API_KEY, else the API key guards them)")
    s.add_argument("--metrics-require-key", action="store_true",
                   help="/metrics needs the API key too (by default only /health and /metrics "
                        "are open)")
    s.add_argument("--allowed-hosts", nargs="*", default=None,
                   help="Host header names the server answers besides IP addresses ('*': any); "
                        "default: any with an API key, else only localhost and --host "
                        "(DNS-rebinding protection)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    s.add_argument("--grpc-port", type=int, default=None,
                   help="also serve octavo's gRPC API (octavo.proto, with health and "
                        "reflection) on this port of --host, on the same engine (needs pip "
                        "install 'octavo[grpc]')")
    add_app_args(s)
    add_engine_args(s)
    # A server answers at once and lets the C++ kernels build behind it on a first start. Its
    # steps take at most 512 tokens (offline: 2048): a burst of prompts is prefilled a few at a
    # time, so the first of them stream sooner (32 clients x 150 tokens, 64 out: TTFT p50 3.7 s
    # -> 2.8 s, output tokens/s 224 -> 235 on SmolLM2 here; offline throughput is 2-4% better
    # with 2048).
    s.set_defaults(run=run, native_kernels="background",
                   max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)


def add_app_args(s: argparse.ArgumentParser) -> None:
    """The flags of the app and its engine front end, shared by `serve` and `run-batch`."""
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use for the model (default: the model argument)")
    s.add_argument("--chat-template", default=None, help="a chat template file or string")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for their first token before 429 (default 4 x "
                        "max-num-seqs)")
    s.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens waiting before 429 (default 16 x max-num-batched-tokens, "
                        "at least 32768)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="largest request body, chunked bodies counted as they arrive (413 "
                        "beyond)")
    s.add_argument("--max-n", type=int, default=16,
                   help="largest n, best_of or beam width of one request")
    s.add_argument("--max-stop", type=int, default=64,
                   help="most stop strings (and stop_token_ids) in one request")
    s.add_argument("--max-stop-length", type=int, default=512,
                   help="longest stop string, in characters")
    s.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs / prompt_logprobs")
    s.add_argument("--preprocess-timeout", type=float, default=30.0,
                   help="seconds one request's tokenizing, chat-template rendering and grammar "
                        "checks may take (400 beyond)")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request still running is aborted (504 with its "
                        "partial usage; streams end with an error event); default: none")
    s.add_argument("--engine-timeout", type=float, default=60.0,
                   help="seconds the engine core may go silent while it has work before "
                        "/health answers 503")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (Jinja code run in a "
                        "sandbox, within --preprocess-timeout)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format of the model's own tool calls, read for tool_choice auto: "
                        "hermes, llama3_json, mistral, pythonic, qwen3_coder, glm45, kimi_k2, "
                        "deepseek_v3, deepseek_v31, openai")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide whether to call tools (tool_choice auto, the "
                        "default when a request has tools); needs --tool-call-parser")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split <think> reasoning from the answer (reasoning_content, thinking "
                        "blocks): deepseek_r1, qwen3, glm45, openai_gptoss")
    s.add_argument("--disable-access-log", action="store_true",
                   help="no access line per request (client, method, path, status, tokens, "
                        "latency, request id)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request's prompt and sampling fields")
    s.add_argument("--enable-log-outputs", action="store_true",
                   help="log each generation request's output text")
    s.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a prompt or output logged (default: all)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), each selected by its name "
                        "in the OpenAI model field: name=path or JSON {\"name\": ..., "
                        "\"path\": ...}")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="let the admin routes /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "change the adapters (needs --lora-root, and --admin-api-key or "
                        "--api-key)")
    s.add_argument("--lora-root", default=None,
                   help="the directory adapters loaded at run time must lie under (their "
                        "paths are resolved, symlinks followed)")
    s.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per generation request to this OTLP "
                        "endpoint (needs pip install 'octavo[otlp]'; the protocol is "
                        "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, the default, or "
                        "http/protobuf)")


def run(args: argparse.Namespace) -> int:
    # Paused until serving (see startup_gc); the core forked in _serve inherits the pause. The
    # collector comes back on however _serve ends: main() may run in a caller's process.
    with startup_gc.collector_paused():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag:
        args.model = args.model_tag
    if args.max_concurrent_connections is not None and not args.max_concurrent_connections > 0:
        raise ValueError(f"--max-concurrent-connections must be > 0, "
                         f"got {args.max_concurrent_connections}")
    api_key = args.api_key or os.environ.get("OCTAVO_API_KEY") or None
    if args.grpc_port is not None:
        _check_grpc(args)
    from octavo.entrypoints.guard import default_allowed_hosts

    state = open_state(args, api_key=api_key,
                       admin_api_key=(args.admin_api_key
                                      or os.environ.get("OCTAVO_ADMIN_API_KEY") or None),
                       metrics_require_key=args.metrics_require_key,
                       allowed_hosts=default_allowed_hosts(args.host, api_key,
                                                           args.allowed_hosts),
                       grpc_address=(None if args.grpc_port is None
                                     else (args.host, args.grpc_port)),
                       grpc_max_calls=args.max_concurrent_connections,
                       shutdown_grace_s=args.shutdown_timeout)
    engine = state.engine
    if not api_key and not _loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach this address "
                       "can use the server (set --api-key or $OCTAVO_API_KEY)", args.host)
    from octavo.entrypoints.http import build_app

    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown (exit code -15); a clean stop
        must exit 0, so the signals only ask the server to stop."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT,
                                                                       signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: the one line that says the server is ready
                logger.info("ready in %.1f s since launch: %s", _seconds_since_launch(), ready)

        def _stop(self, sig: int, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    app = build_app(state, args.allowed_origins)
    # uvicorn's own access log stays off: request_log writes the one access line per request.
    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=logging.getLogger().level,
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=False,
        limit_concurrency=args.max_concurrent_connections))
    exit_code = 0

    def on_engine_death() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    state.on_engine_death = on_engine_death
    server.config.load()  # uvicorn's protocol imports, while the core still loads
    engine.wait_until_ready()
    startup_gc.settle()
    block_size = engine.config.core_block_size
    ready = (f"{engine.setup.source.name} ({engine.loaded}), KV cache "
             f"{engine.num_blocks * block_size:,} tokens, context {engine.max_model_len:,}; "
             f"serving as {', '.join(state.served_model_names)} on "
             f"http://{args.host}:{args.port}")
    if args.grpc_port is not None:
        ready += f" and gRPC {args.host}:{args.grpc_port}"
    import asyncio  # not at the top: 0.025 s that the core's launch would wait for

    asyncio.run(server.serve())
    return exit_code


def _check_grpc(args: argparse.Namespace) -> None:
    """Before the model loads: the gRPC extra is installed and the port is its own."""
    if not 0 < args.grpc_port < 65536 or args.grpc_port == args.port:
        raise ValueError(f"--grpc-port must be a port other than --port ({args.port}), got "
                         f"{args.grpc_port}")
    try:
        import octavo.entrypoints.grpc.server  # noqa: F401  (its stubs check their runtime)
    except ImportError as exc:
        raise ValueError(f"--grpc-port needs the gRPC extra: pip install 'octavo[grpc]' "
                         f"({exc})") from None


def _seconds_since_launch() -> float:
    """Since this process started (the interpreter's own start included), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):  # no /proc: since this module was imported
        return time.perf_counter() - _IMPORTED


def open_state(args: argparse.Namespace, **server: object) -> ServerState:
    """Check the app flags (`add_app_args`), launch the engine core and build the server's
    state; `server`: further ServerState fields (keys, hosts). The core loads while this
    returns: `engine.wait_until_ready()` (or the app's start) waits for it."""
    from octavo.engine.core_launch import launch_cores

    for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes", "max_n",
                 "max_stop", "max_stop_length", "preprocess_timeout", "request_timeout",
                 "engine_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if args.max_logprobs < -1:  # -1: no cap, the whole vocabulary may be asked for (as vLLM)
        raise ValueError(f"--max-logprobs must be >= 0, or -1 for no cap; got "
                         f"{args.max_logprobs}")
    _check_lora_flags(args, server)
    from octavo.entrypoints.request_log import RequestLogConfig

    request_log = RequestLogConfig(not args.disable_access_log, args.enable_log_requests,
                                   args.enable_log_outputs, args.max_log_len,
                                   args.max_request_bytes)
    tracer = None
    if args.otlp_traces_endpoint is not None:  # a missing extra fails here, before the model
        from octavo.entrypoints.tracing import Tracer

        tracer = Tracer(args.otlp_traces_endpoint)
    config = EngineConfig.from_cli(args)
    # The core process starts first: its torch import is most of a start, and the front end's
    # own imports and set-up below run beside it.
    cores = launch_cores(config)
    try:
        template = args.chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text()
        from octavo.serving.chat_output import ChatParsers

        # Checked before the model loads: an unknown parser name lists the choices.
        parsers = ChatParsers.from_flags(args.tool_call_parser, args.enable_auto_tool_choice,
                                         args.reasoning_parser)
        from octavo.engine.async_engine import AsyncEngine, ServingLimits
        from octavo.engine.processor import RequestLimits
    except BaseException:
        for core in cores:
            core.abandon()
        raise
    limits = ServingLimits(args.max_queued_requests, args.max_queued_tokens,
                           RequestLimits(args.max_n, args.max_stop, args.max_stop_length,
                                         args.max_logprobs),
                           args.preprocess_timeout, args.engine_timeout)
    engine = AsyncEngine(config, limits, cores)
    from octavo.entrypoints.http import ServerState
    from octavo.entrypoints.openai.lora import add_startup_adapters

    names = args.served_model_name or [args.model]
    try:
        add_startup_adapters(engine.processor.adapters, args.lora_modules, names)
    except BaseException:
        engine.close()
        raise

    parsers = parsers.for_vocab(engine.tokenizer.get_vocab())
    if parsers.reasoning_parser is not None and parsers.reasoning_end is None:
        logger.warning("--reasoning-parser %s: <think> and </think> are not single tokens of "
                       "this model, so structured output and tool_choice required/named apply "
                       "from the first token (those outputs have no reasoning)",
                       args.reasoning_parser)
    return ServerState(engine, names, chat_template=template,
                       parsers=parsers, max_request_bytes=args.max_request_bytes,
                       trust_request_chat_template=args.trust_request_chat_template,
                       request_timeout_s=args.request_timeout, request_log=request_log,
                       allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                       lora_root=args.lora_root,
                       tracer=tracer, **server)


def _check_lora_flags(args: argparse.Namespace, server: dict) -> None:
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if not args.allow_runtime_lora_updating:
        return
    if not args.lora_root or not Path(args.lora_root).is_dir():
        raise ValueError("--allow-runtime-lora-updating needs --lora-root, an existing "
                         "directory that adapters loaded at run time must lie under")
    if not (server.get("admin_api_key") or server.get("api_key")):
        raise ValueError("--allow-runtime-lora-updating needs --admin-api-key (or --api-key): "
                         "the routes that load adapters must not be open")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
