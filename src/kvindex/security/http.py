"""The HTTP API's guards, as plain ASGI middleware: bearer tokens and request deadlines.

- `BearerAuth`: with a token, every request needs `Authorization: Bearer TOKEN`, except
  `/healthz` (for load balancers and probes) and `/metrics` (for scrapers) unless a metrics
  token is set, which `/metrics` then needs (the main token works there too). Tokens are
  compared in constant time; a refusal is `401 {"error": ...}` with `WWW-Authenticate`.
- `RequestDeadline`: a request body must arrive within `timeout` seconds (a client that
  trickles its body can't hold a connection and its buffer forever): `408 {"error": ...}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

__all__ = ["BearerAuth", "HttpGuard", "RequestDeadline", "error_response"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/"})
# The dashboard's page and assets hold no data: a browser must load them to ask for a token.
OPEN_PREFIXES = ("/dashboard/",)
TOKEN_COOKIE = b"kvindex_token"
METRICS_PATH = "/metrics"


async def error_response(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer` header, else of the dashboard's cookie (a
    browser's EventSource can't send headers; the cookie is SameSite=Strict, so no other
    site can make a browser use it)."""
    cookie: bytes | None = None
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, credentials = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                return credentials.strip()
            return None
        if name == b"cookie":
            cookie = _cookie_token(bytes(value)) or cookie
    return cookie


def _cookie_token(header: bytes) -> bytes | None:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == TOKEN_COOKIE and value:
            return unquote_to_bytes(value)
    return None


def _tokens_for(path: str, token: bytes | None, metrics_token: bytes | None) -> list[bytes]:
    """The tokens any one of which opens `path` (empty: open to all)."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return []
    if path == METRICS_PATH:
        if metrics_token is None:
            return []
        return [t for t in (metrics_token, token) if t is not None]
    return [token] if token is not None else []


def _matches(given: bytes, tokens: list[bytes]) -> bool:
    # Every token is compared (no early exit), each in constant time.
    found = False
    for token in tokens:
        found |= hmac.compare_digest(given, token)
    return found


class BearerAuth:
    """Requires `Authorization: Bearer ...` (see the module docstring for which paths)."""

    def __init__(self, app: ASGIApp, token: str | None, metrics_token: str | None = None) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.metrics_token = metrics_token.encode() if metrics_token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tokens = _tokens_for(scope.get("path", ""), self.token, self.metrics_token)
        if tokens:
            given = _bearer(scope)
            if given is None or not _matches(given, tokens):
                why = "a bearer token is required" if given is None else "invalid bearer token"
                challenge = [(b"www-authenticate", b'Bearer realm="kvindex"')]
                await error_response(send, 401, why, challenge)
                return
        await self.app(scope, receive, send)


class RequestDeadline:
    """Answers 408 if a request's body has not fully arrived `timeout` seconds after the
    request started."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        started = False
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                # Past the body, `receive` only waits for the client to go away (a streaming
                # response such as the dashboard's SSE listens for that): no deadline.
                return await receive()
            remaining = deadline - loop.time()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout from None
            body_done = message.get("type") != "http.request" or not message.get("more_body")
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started |= message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _BodyTimeout:
            if not started:
                await error_response(send, 408, f"request body not received in {self.timeout} s")


class _BodyTimeout(Exception):
    pass


@dataclass(frozen=True, slots=True)
class HttpGuard:
    """The API's access rules and limits (`kvindex serve --token ...`)."""

    token: str | None = None
    metrics_token: str | None = None
    max_lookup_items: int = 1_000_000  # token ids (or block hashes) in one lookup
    request_timeout: float = 30.0  # for a request's body to arrive

    def admits(self, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request passes every rule that needs no body (its bearer token), as
        the middleware would judge it. A path that answers outside the ASGI stack
        (kvindex.service.fastpath) asks this, and leaves a request it refuses to the stack,
        which words the refusal: a rule added to the middleware belongs here too."""
        token = self.token.encode() if self.token else None
        metrics_token = self.metrics_token.encode() if self.metrics_token else None
        tokens = _tokens_for(path, token, metrics_token)
        if not tokens:
            return True
        given = _bearer({"headers": headers})
        return given is not None and _matches(given, tokens)

    def install(self, app: Any) -> None:
        """Add the middleware to a Starlette/FastAPI app (outermost: auth, then the body
        deadline), and document the bearer scheme in its OpenAPI."""
        app.add_middleware(RequestDeadline, timeout=self.request_timeout)
        if self.token or self.metrics_token:
            app.add_middleware(BearerAuth, token=self.token, metrics_token=self.metrics_token)
        if self.token:
            _document_bearer(app)


def _document_bearer(app: Any) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes["bearer"] = {"type": "http", "scheme": "bearer"}
            schema["security"] = [{"bearer": []}]
            for path in OPEN_PATHS:
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation["security"] = []
        return dict(app.openapi_schema)

    app.openapi = openapi
