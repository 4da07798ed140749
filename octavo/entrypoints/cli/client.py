"""`octavo chat --url URL` and `octavo complete`: terminal clients of a running server, as
`vllm chat` and `vllm complete` are. Each reads messages (or prompts) from stdin and streams the
reply; `--quick TEXT` sends one and exits. The model is `--model`, else the first the server
lists at /v1/models."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(RuntimeError):
    """The server refused a request, or could not be reached."""


def add_client_args(p: argparse.ArgumentParser, url_help: str, default_url: str | None
                    ) -> None:
    p.add_argument("--url", default=default_url, help=url_help)
    p.add_argument("--api-key", default=None,
                   help="the server's API key (default: $OCTAVO_API_KEY)")
    p.add_argument("-q", "--quick", default=None, metavar="TEXT",
                   help="send this one message, print the reply and exit")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="complete prompts on a running server (streams; one "
                                        "prompt per line of input)")
    add_client_args(p, f"the server (default {DEFAULT_URL})", DEFAULT_URL)
    p.add_argument("--model", default=None,
                   help="the served model name (default: the first at /v1/models)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per completion (default: the server's, 16)")
    p.add_argument("--temperature", type=float, default=None)
    p.set_defaults(run=run_complete)


class Client:
    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        key = api_key or os.environ.get("OCTAVO_API_KEY")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: noise here
        self.http = httpx.Client(base_url=url.rstrip("/").removesuffix("/v1"),
                                 headers={"Authorization": f"Bearer {key}"} if key else {},
                                 timeout=httpx.Timeout(30.0, read=None))
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        data = self._json(self._call("GET", "/v1/models")).get("data") or []
        if not data:
            raise ClientError("the server lists no models at /v1/models")
        return data[0]["id"]

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ClientError(f"cannot reach {self.http.base_url}: {exc}") from None
        if response.status_code >= 400:
            raise ClientError(_error_message(response))
        return response

    @staticmethod
    def _json(response: httpx.Response) -> dict:
        try:
            return response.json()
        except ValueError:
            raise ClientError(f"the server answered {response.status_code} with a body that "
                              f"is not JSON") from None

    def stream(self, path: str, body: dict) -> Iterator[tuple[str, str]]:
        """('content' | 'reasoning', text) pieces of a streamed reply."""
        body = {"model": self.model, **body, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ClientError(_error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        raise ClientError(event["error"].get("message", str(event["error"])))
                    for choice in event.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning_content"):
                            yield "reasoning", delta["reasoning_content"]
                        text = choice.get("text", delta.get("content"))
                        if text:
                            yield "content", text
        except httpx.HTTPError as exc:
            raise ClientError(f"the connection to {self.http.base_url} failed: {exc}") from None


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except ValueError:
        message = response.text[:500]
    return f"{response.status_code}: {message}"


def _print_reply(pieces: Iterator[tuple[str, str]]) -> str:
    """Prints the reply as it streams (reasoning to stderr); returns its content."""
    content = []
    for kind, text in pieces:
        if kind == "reasoning":
            print(text, end="", file=sys.stderr, flush=True)
        else:
            content.append(text)
            print(text, end="", flush=True)
    print()
    return "".join(content)


def input_lines(prompt: str) -> Iterator[str]:
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return


def run_chat_client(args: argparse.Namespace, sampling: dict[str, Any]) -> int:
    """The chat REPL over HTTP; `sampling`: body fields from the command line."""
    try:
        client = Client(args.url, args.api_key, args.model)
        system = [{"role": "system", "content": args.system}] if args.system else []
        if args.quick is not None:
            _print_reply(client.stream("/v1/chat/completions", {
                "messages": system + [{"role": "user", "content": args.quick}], **sampling}))
            return 0
        print(f"octavo chat with {client.model} at {client.http.base_url}: type a message, "
              f"/reset to start over, Ctrl-D to quit.", file=sys.stderr)
        history = list(system)
        for line in input_lines("> "):
            if line.strip() == "/reset":
                history = list(system)
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = _reply(client, "/v1/chat/completions",
                           {"messages": history, **sampling})
            if reply is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})
        return 0
    except ClientError as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 1


def run_complete(args: argparse.Namespace) -> int:
    sampling = {k: v for k, v in (("max_tokens", args.max_tokens),
                                  ("temperature", args.temperature)) if v is not None}
    try:
        client = Client(args.url, args.api_key, args.model)
        if args.quick is not None:
            _print_reply(client.stream("/v1/completions", {"prompt": args.quick, **sampling}))
            return 0
        print(f"octavo complete with {client.model} at {client.http.base_url}: type a prompt, "
              f"Ctrl-D to quit.", file=sys.stderr)
        for line in input_lines("> "):
            if line.strip():
                _reply(client, "/v1/completions", {"prompt": line, **sampling})
        return 0
    except ClientError as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 1


def _reply(client: Client, path: str, body: dict) -> str | None:
    """One streamed reply in the REPL, None when it did not complete: a refusal is printed and
    the REPL goes on; Ctrl-C stops the reply (closing the stream aborts it on the server)."""
    pieces = client.stream(path, body)
    try:
        return _print_reply(pieces)
    except ClientError as exc:
        print(f"\noctavo: error: {exc}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        pieces.close()
        print()
        return None
