"""`octavo bench startup`: launch a server, time launch -> first streamed token of a first request,
then the latency of the next few requests.

Each run starts a fresh process (`octavo serve`, or `llama_cpp.server` with `--backends
octavo,llama.cpp`), retries the request until the server answers, and stops the process. The
disk cache is warm after the first run, so the median is the warm start. `octavo-first` is a
first-ever start: each run gets an empty $OCTAVO_CACHE holding only what `pip install` and
`octavo pull` leave (the kernels and the model file), so every other cache (tokenizer, config,
prepared weights) is made during the start being timed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

BACKENDS = ("octavo", "octavo-first", "llama.cpp")


def register(kinds: argparse._SubParsersAction) -> None:
    s = kinds.add_parser("startup", help="launch -> first token of a first request")
    s.add_argument("--model", default="smollm2-135m-instruct")
    s.add_argument("--backends", default="octavo", help=f"comma-separated: {', '.join(BACKENDS)}")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one start")
    s.add_argument("--requests", type=int, default=3,
                   help="requests timed after the first token, one at a time")
    s.add_argument("--request-tokens", type=int, default=64, help="tokens each of them decodes")
    s.add_argument("--server-args", default="",
                   help="extra arguments for `octavo serve`, as one string")
    s.add_argument("--json", default=None)
    s.set_defaults(run=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(backend: str, model: str, port: int, extra: str) -> list[str]:
    if backend.startswith("octavo"):
        return [sys.executable, "-m", "octavo.entrypoints.cli.main", "serve", "--model", model,
                "--port", str(port), *extra.split()]
    from octavo.model_source import resolve_model

    source = resolve_model(model)
    if not source.is_gguf:
        raise ValueError("--backends llama.cpp needs a GGUF model")
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(source.path),
            "--port", str(port), "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 1)]


def _first_token(client: httpx.Client, proc: subprocess.Popen, port: int,
                 deadline: float) -> float | None:
    """Retry a one-token streamed completion until a token arrives; the time it arrived (None if
    the server exits or the deadline passes first). `client` is made before the launch and
    reused: a new httpx client per try builds an SSL context, about 30 ms of CPU every 20 ms,
    which the server being timed would lose."""
    body = {"prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0}
    while time.perf_counter() < deadline and proc.poll() is None:
        try:
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                               json=body) as r:
                if r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"text"' in line:
                            return time.perf_counter()
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    return None


def _first_ever_cache(model: str) -> str:
    """An empty cache but for the kernels' build and the model's file (linked)."""
    from octavo.model_source import cache_dir, resolve_model

    resolve_model(model)  # fetched into the user's cache, as `octavo pull` would
    scratch = tempfile.mkdtemp(prefix="octavo-first-start-")
    for name in ("kernels", "models"):
        if (cache_dir() / name).is_dir():
            os.symlink(cache_dir() / name, os.path.join(scratch, name))
    return scratch


def _requests(client: httpx.Client, port: int, count: int, tokens: int) -> list[float]:
    """Seconds for each of `count` requests of `tokens` tokens, one after another."""
    body = {"prompt": "Write a story about a lighthouse keeper.", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        r = client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        r.raise_for_status()
        seconds.append(time.perf_counter() - start)
    return seconds


def _once(backend: str, args: argparse.Namespace) -> tuple[float, list[float]]:
    port = _free_port()
    cmd = _command(backend, args.model, port, args.server_args)
    env = dict(os.environ)
    scratch = None
    if backend == "octavo-first":
        scratch = env["OCTAVO_CACHE"] = _first_ever_cache(args.model)
    # The log goes to a file: an unread pipe fills up and stalls a chatty server.
    log = tempfile.TemporaryFile(mode="w+")
    client = httpx.Client(timeout=600)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        got = _first_token(client, proc, port, start + args.timeout)
        if got is None:
            log.seek(0)
            tail = log.read()[-2000:]
            why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                   else f"gave no token within {args.timeout} s")
            raise RuntimeError(f"{backend} {why}; its log ends with:\n{tail}")
        return got - start, _requests(client, port, args.requests, args.request_tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        client.close()
        log.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.requests < 0 or args.request_tokens < 1:
        raise ValueError("--requests must be >= 0 and --request-tokens >= 1")
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    after: dict[str, list[list[float]]] = {b: [] for b in backends}
    for _ in range(args.repeats):
        for b in backends:
            first, later = _once(b, args)
            seconds[b].append(first)
            after[b].append(later)
    report = {"model": args.model, "repeats": args.repeats,
              "runs_seconds": {b: [round(x, 3) for x in v] for b, v in seconds.items()},
              "results": {b: {"launch_to_first_token_s": round(statistics.median(v), 3),
                              "requests_s": [round(statistics.median(r[i] for r in after[b]), 3)
                                             for i in range(args.requests)]}
                          for b, v in seconds.items()}}
    for b in backends:
        res = report["results"][b]
        print(f"{b:>12}: launch -> first token {res['launch_to_first_token_s']} s (median of "
              f"{args.repeats}; runs {report['runs_seconds'][b]}); then {args.requests} requests "
              f"of {args.request_tokens} tokens: {res['requests_s']} s")
    if len(backends) > 1:
        a, c = (statistics.median(seconds[x]) for x in backends[:2])
        report["ratio"] = round(a / c, 3)
        print(f"{backends[0]} / {backends[1]}: {a / c:.2f}x the start-up time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
