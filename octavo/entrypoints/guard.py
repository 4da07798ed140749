"""The ASGI layer in front of every route: header limits, the Host allow-list, API keys and the
body limit, checked in that order before a route sees the request.

The body is read here whole, counting the bytes as they arrive, so a chunked body with no
Content-Length meets the same limit (413) as a declared one; the route then reads it from memory
and the connection's later messages (a disconnect) pass through untouched.
"""
from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorSender = Callable[[Scope, Receive, Send, int, str], Awaitable[None]]

MAX_HEADERS = 100  # more header lines than any real client sends
MAX_HEADER_BYTES = 32 << 10  # h11 bounds only headers that arrive in pieces, so count them here
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


@dataclass(frozen=True)
class GuardPolicy:
    api_key: str | None
    admin_api_key: str | None
    max_request_bytes: int
    # Host names answered besides IP literals (DNS rebinding needs a name); None: any Host
    allowed_hosts: frozenset[str] | None
    metrics_require_key: bool = False

    def open_paths(self) -> frozenset[str]:
        """Routes that no key guards."""
        return frozenset({"/health"} if self.metrics_require_key else {"/health", "/metrics"})


ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/v1/load_lora_adapter",
                         "/v1/unload_lora_adapter"})


class Guard:
    def __init__(self, app: ASGIApp, policy: GuardPolicy, send_error: ErrorSender) -> None:
        self.app = app
        self.policy = policy
        self.send_error = send_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self._check_headers(scope)
        if problem is not None:
            await self.send_error(scope, receive, send, *problem)
            return
        length = _header(scope, b"content-length")
        limit = self.policy.max_request_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self.send_error(scope, receive, send, 413 if length.isdigit() else 400,
                                  f"request body of {length[:40]} bytes exceeds "
                                  f"max_request_bytes ({limit})" if length.isdigit()
                                  else "Content-Length is not a number")
            return
        body, more = await _read_body(receive, limit)
        if more:
            await self.send_error(scope, receive, send, 413, f"request body exceeds "
                                  f"max_request_bytes ({limit})")
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope) -> tuple[int, str] | None:
        policy = self.policy
        if len(scope["headers"]) > MAX_HEADERS:
            return 431, f"more than {MAX_HEADERS} request headers"
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return 431, f"request headers of more than {MAX_HEADER_BYTES} bytes"
        if policy.allowed_hosts is not None:
            host = _host_name(_header(scope, b"host") or "")
            if host not in policy.allowed_hosts and not _is_ip(host):
                return 400, (f"Host {host[:100]!r} is not allowed (a server without an API key "
                             f"answers only its own names; see --allowed-hosts)")
        path, method = scope["path"], scope["method"]
        if method == "OPTIONS" or path in policy.open_paths():
            return None
        if path in ADMIN_PATHS and policy.admin_api_key:
            if not _authorized(scope, policy.admin_api_key):
                return 401, "this route needs the admin API key (--admin-api-key)"
            return None
        if policy.api_key and not _authorized(scope, policy.api_key):
            return 401, "missing or wrong API key"
        return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """The Host header without its port ('[::1]:8000' -> '[::1]', 'a.b:80' -> 'a.b')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def default_allowed_hosts(bind_host: str, api_key: str | None,
                          extra: list[str] | None) -> frozenset[str] | None:
    """The Host allow-list: `--allowed-hosts` if given ('*': any), else none with an API key
    (a rebinding page cannot send the key), else loopback names and the bind name (with any
    IP literal, see the guard)."""
    if extra:
        return None if "*" in extra else frozenset(h.lower() for h in extra) | LOOPBACK_HOSTS
    if api_key:
        return None
    return LOOPBACK_HOSTS | {bind_host.lower()}


def _authorized(scope: Scope, key: str) -> bool:
    return key_matches(_header(scope, b"authorization"), _header(scope, b"x-api-key"), key)


def key_matches(authorization: str | None, x_api_key: str | None, key: str) -> bool:
    """Does `Authorization: Bearer <key>` (else `x-api-key: <key>`) give `key`? The HTTP
    headers and the gRPC metadata of the same names carry it alike."""
    given = x_api_key
    auth = authorization or ""
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given is not None and hmac.compare_digest(given.encode("latin-1", "replace"),
                                                     key.encode())


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole body, or (what was read, True) once it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before the body ended
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
