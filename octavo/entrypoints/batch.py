"""The OpenAI batch file format, run through the server's own routes.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line, in input
order, is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
A request the route answered carries the route's status and JSON body (an error body on a 4xx
or 5xx, whose `error` object is repeated in `error`, as vLLM writes it). A line that never
reached a route (not JSON, no custom_id, a repeated custom_id, another method or url, a
streamed body) has `response: null` and `error: {"code": "invalid_request", "message", "param",
"line"}`. No line stops the batch.

The requests go to an `httpx.AsyncClient`: over the network to a running server, or in process
to the app itself (`octavo run-batch` builds one on an `httpx.ASGITransport`), so every body
is validated and answered exactly as the HTTP routes do. Up to `concurrency` run at once,
batched by the engine. The output is written to a temporary file beside the target and renamed
over it only once every line is done: an interrupted batch leaves no output file.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_BUSY_RETRIES = 60  # a 429 (the engine's queue is full) is waited out, this many times


class BatchLineError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_line(text: str, seen: set[str]) -> tuple[str, str, dict]:
    """(custom_id, url, body) of one input line; BatchLineError names what is wrong. `seen`
    collects the custom ids so far (each must be unique)."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise BatchLineError(f"the line is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BatchLineError("the line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("'custom_id' must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise BatchLineError(f"custom_id {custom_id!r} is used by an earlier line; each must "
                             f"be unique", "custom_id")
    seen.add(custom_id)
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchLineError(f"unknown field(s) {', '.join(map(repr, unknown))} (a line has "
                             f"custom_id, method, url and body)", unknown[0])
    if obj.get("method") != "POST":
        raise BatchLineError(f"'method' must be \"POST\", got {obj.get('method')!r}", "method")
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        raise BatchLineError(f"'url' {url!r} is not supported; use one of "
                             f"{', '.join(SUPPORTED_URLS)}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("'body' must be a JSON object", "body")
    if body.get("stream"):
        raise BatchLineError("'body.stream' must be false: a batch line gets one whole "
                             "response", "body.stream")
    return custom_id, url, body


def line_error(custom_id: str | None, line_no: int, exc: BatchLineError) -> dict:
    return {"id": _record_id(), "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": f"line {line_no}: {exc}",
                      "param": exc.param, "line": line_no}}


def response_record(custom_id: str, response: httpx.Response) -> dict:
    try:
        body: Any = response.json()
    except ValueError:
        body = {"error": {"message": response.text[:1000], "type": "InvalidResponse",
                          "param": None, "code": response.status_code}}
    error = None
    if response.status_code >= 400:
        error = body.get("error", body) if isinstance(body, dict) else body
    return {"id": _record_id(), "custom_id": custom_id,
            "response": {"status_code": response.status_code,
                         "request_id": response.headers.get("x-request-id")
                         or f"req-{secrets.token_hex(8)}",
                         "body": body},
            "error": error}


def _record_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


class OrderedAtomicWriter:
    """Writes records in input order to a temporary file beside `path`; `commit` renames it
    over `path`, `discard` removes it. Out-of-order records wait in memory only until the
    lines before them are done."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        # O_EXCL: never another's file; mode 0o666 less the umask, as a plain open would make
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        self.next = 0
        self.pending: dict[int, dict] = {}
        self.written = 0

    def put(self, index: int, record: dict) -> None:
        self.pending[index] = record
        while self.next in self.pending:
            self.file.write(json.dumps(self.pending.pop(self.next), ensure_ascii=False) + "\n")
            self.next += 1
            self.written += 1

    def commit(self) -> None:
        if self.pending:
            raise RuntimeError(f"batch output incomplete: line {self.next + 1} has no result")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class BatchRunner:
    """Runs the lines of a batch file through `client` (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, concurrency: int,
                 on_done: Callable[[], None] = lambda: None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.concurrency = concurrency
        self.on_done = on_done
        self.failed = 0

    async def run(self, lines: Iterable[str], writer: OrderedAtomicWriter) -> int:
        """Every non-blank line's record goes to `writer`, in order; returns their count."""
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        faults: list[BaseException] = []  # a task that failed: the batch stops with it

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            slots.release()
            if not task.cancelled() and task.exception() is not None:
                faults.append(task.exception())

        seen: set[str] = set()
        index = 0
        try:
            for line_no, text in enumerate(lines, 1):
                if faults:
                    raise faults[0]
                if not text.strip():
                    continue
                try:
                    custom_id, url, body = parse_line(text, seen)
                except BatchLineError as exc:
                    writer.put(index, line_error(_custom_id_of(text), line_no, exc))
                    self.failed += 1
                    self.on_done()
                else:
                    await slots.acquire()
                    task = asyncio.create_task(self._send(index, custom_id, url, body, writer))
                    tasks.add(task)
                    task.add_done_callback(done)
                index += 1
            while tasks and not faults:
                await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
            if faults:
                raise faults[0]
        finally:
            for task in list(tasks):
                task.cancel()
        return index

    async def _send(self, index: int, custom_id: str, url: str, body: dict,
                    writer: OrderedAtomicWriter) -> None:
        for attempt in range(MAX_BUSY_RETRIES + 1):
            try:
                response = await self.client.post(url, json=body)
            except httpx.HTTPError as exc:
                record = {"id": _record_id(), "custom_id": custom_id, "response": None,
                          "error": {"code": "request_failed",
                                    "message": f"{type(exc).__name__}: {exc}", "param": None,
                                    "line": None}}
                break
            if response.status_code != 429 or attempt == MAX_BUSY_RETRIES:
                record = response_record(custom_id, response)
                break
            await asyncio.sleep(_retry_after(response))
        if record["error"] is not None:
            self.failed += 1
        writer.put(index, record)
        self.on_done()


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.1), 30.0)
    except ValueError:
        return 1.0


def _custom_id_of(text: str) -> str | None:
    """The custom_id of a line that failed its checks, where it has one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


def count_lines(path: str | os.PathLike) -> int:
    """Non-blank lines of a batch file (the progress bar's total)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())
