"""`octavo bench startup`: launch a server, time launch -> first streamed token of a first request.

Each run starts a fresh process (`octavo serve`, or `llama_cpp.server` with `--backends
octavo,llama.cpp`), retries the request until the server answers, and stops the process. The
disk cache is warm after the first run, so the median is the warm start.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

BACKENDS = ("octavo", "llama.cpp")


def register(kinds: argparse._SubParsersAction) -> None:
    s = kinds.add_parser("startup", help="launch -> first token of a first request")
    s.add_argument("--model", default="smollm2-135m-instruct")
    s.add_argument("--backends", default="octavo", help=f"comma-separated: {', '.join(BACKENDS)}")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one start")
    s.add_argument("--server-args", default="",
                   help="extra arguments for `octavo serve`, as one string")
    s.add_argument("--json", default=None)
    s.set_defaults(run=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(backend: str, model: str, port: int, extra: str) -> list[str]:
    if backend == "octavo":
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


def _once(backend: str, args: argparse.Namespace) -> float:
    port = _free_port()
    cmd = _command(backend, args.model, port, args.server_args)
    # The log goes to a file: an unread pipe fills up and stalls a chatty server.
    log = tempfile.TemporaryFile(mode="w+")
    client = httpx.Client(timeout=60)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        got = _first_token(client, proc, port, start + args.timeout)
        if got is None:
            log.seek(0)
            tail = log.read()[-2000:]
            why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                   else f"gave no token within {args.timeout} s")
            raise RuntimeError(f"{backend} {why}; its log ends with:\n{tail}")
        return got - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        client.close()
        log.close()


def run(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.repeats):
        for b in backends:
            seconds[b].append(_once(b, args))
    report = {"model": args.model, "repeats": args.repeats,
              "runs_seconds": {b: [round(x, 3) for x in v] for b, v in seconds.items()},
              "results": {b: {"launch_to_first_token_s": round(statistics.median(v), 3)}
                          for b, v in seconds.items()}}
    for b in backends:
        print(f"{b:>10}: launch -> first token {report['results'][b]['launch_to_first_token_s']}"
              f" s (median of {args.repeats}; runs {report['runs_seconds'][b]})")
    if len(backends) > 1:
        a, c = (statistics.median(seconds[x]) for x in backends[:2])
        report["ratio"] = round(a / c, 3)
        print(f"{backends[0]} / {backends[1]}: {a / c:.2f}x the start-up time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
