"""`octavo serve [MODEL]`: the OpenAI- and Anthropic-compatible HTTP server."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from pathlib import Path

from octavo import startup_gc
from octavo.config import DEFAULT_MODEL, EngineConfig, add_engine_args

SERVE_MAX_NUM_BATCHED_TOKENS = 512

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"the model (default {DEFAULT_MODEL}); same as --model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="required bearer / x-api-key (default: $OCTAVO_API_KEY, else none)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use for the model (default: the model argument)")
    s.add_argument("--chat-template", default=None, help="a chat template file or string")
    s.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins ('*' = any)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for their first token before 429 (default 4 x "
                        "max-num-seqs)")
    s.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens waiting before 429 (default 16 x max-num-batched-tokens, "
                        "at least 32768)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="largest request body (413 beyond)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format of the model's own tool calls, read for tool_choice auto: "
                        "hermes, llama3_json, mistral, pythonic")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide whether to call tools (tool_choice auto, the "
                        "default when a request has tools); needs --tool-call-parser")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split <think> reasoning from the answer (reasoning_content, thinking "
                        "blocks): deepseek_r1, qwen3")
    add_engine_args(s)
    # A server answers at once and lets the C++ kernels build behind it on a first start. Its
    # steps take at most 512 tokens (offline: 2048): a burst of prompts is prefilled a few at a
    # time, so the first of them stream sooner (32 clients x 150 tokens, 64 out: TTFT p50 3.7 s
    # -> 2.8 s, output tokens/s 224 -> 235 on SmolLM2 here; offline throughput is 2-4% better
    # with 2048).
    s.set_defaults(run=run, native_kernels="background",
                   max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)


def run(args: argparse.Namespace) -> int:
    # Paused until serving (see startup_gc); the core forked in _serve inherits the pause. The
    # collector comes back on however _serve ends: main() may run in a caller's process.
    with startup_gc.collector_paused():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from octavo.engine.core_launch import launch_core

    if args.model_tag:
        args.model = args.model_tag
    for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    config = EngineConfig.from_cli(args)
    # The core process starts first: its torch import is most of a start, and the front end's
    # own imports and set-up below run beside it.
    core = launch_core(config)
    try:
        template = args.chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text()
        from octavo.serving.chat_output import ChatParsers

        # Checked before the model loads: an unknown parser name lists the choices.
        parsers = ChatParsers.from_flags(args.tool_call_parser, args.enable_auto_tool_choice,
                                         args.reasoning_parser)
        from octavo.engine.async_engine import AsyncEngine
    except BaseException:
        core.abandon()
        raise
    engine = AsyncEngine(config, args.max_queued_requests, args.max_queued_tokens, core)
    from octavo.entrypoints.http import ServerState, build_app

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

        def _stop(self, sig: int, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True


    parsers = parsers.for_vocab(engine.tokenizer.get_vocab())
    if parsers.reasoning_parser is not None and parsers.reasoning_end is None:
        logger.warning("--reasoning-parser %s: <think> and </think> are not single tokens of "
                       "this model, so structured output and tool_choice required/named apply "
                       "from the first token (those outputs have no reasoning)",
                       args.reasoning_parser)
    state = ServerState(engine, args.served_model_name or [args.model],
                        api_key=args.api_key or os.environ.get("OCTAVO_API_KEY") or None,
                        chat_template=template, parsers=parsers,
                        max_request_bytes=args.max_request_bytes)
    app = build_app(state, args.allowed_origins)
    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=logging.getLogger().level,
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=False))
    exit_code = 0

    def on_engine_death() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    state.on_engine_death = on_engine_death
    server.config.load()  # uvicorn's protocol imports, while the core still loads
    engine.wait_until_ready()
    startup_gc.settle()
    logger.info("serving %s as %s on http://%s:%d", args.model,
                ", ".join(state.served_model_names), args.host, args.port)
    import asyncio  # not at the top: 0.025 s that the core's launch would wait for

    asyncio.run(server.serve())
    return exit_code
