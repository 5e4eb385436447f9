"""The HTTP API's guards, as plain ASGI middleware: Host names, bearer tokens, the
dashboard's session cookie and request deadlines.

- `HostAllowList`: a request naming a host that is not on the list is refused (`400`), so
  a page whose DNS name is rebound to this address (DNS rebinding) can't read the API from
  a visitor's browser, even with no token set. IP literals always pass (rebinding needs a
  name); by default the list is `localhost` and the name serve is bound to (with a
  wildcard bind, the machine's own names).
- `BearerAuth`: with a token, every request needs `Authorization: Bearer TOKEN`, except
  `/healthz` (for load balancers and probes) and `/metrics` (for scrapers) unless a metrics
  token is set, which `/metrics` then needs (the main token works there too). Tokens are
  compared in constant time; a refusal is `401 {"error": ...}` with `WWW-Authenticate`.
  The dashboard (a browser's event stream can't send headers) trades the token once, at
  `/?token=TOKEN`, for a session cookie: `HttpOnly` (no script reads it), `SameSite=Strict`
  (no other site's request carries it), `Secure` over TLS, scoped to `/v1/dashboard/`
  and accepted there only, and holding a value derived from the token, not the token
  (cookies are sent to every port of a host).
- Two kinds of client: the query token reads and looks up; changing the fleet (`POST` and
  `DELETE` under `/v1/instances`, the peers' `/register` and `/unregister`) takes the
  admin token, which opens everything the query token opens too. With a query token and no
  admin token, or with fleet changes turned off, those paths answer `403` to everyone.
- `RequestDeadline`: a request body must arrive within `timeout` seconds (a client that
  trickles its body can't hold a connection and its buffer forever): `408 {"error": ...}`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes, urlencode

__all__ = [
    "AccessRules",
    "BearerAuth",
    "HostAllowList",
    "HttpGuard",
    "RequestDeadline",
    "changes_fleet",
    "default_allowed_hosts",
    "error_response",
    "session_value",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/livez", "/"})  # probes carry no token
# The dashboard's page and assets hold no data: a browser must load them to ask for a token.
OPEN_PREFIXES = ("/dashboard/",)
METRICS_PATH = "/metrics"
LOGIN_PATH = "/"  # the dashboard's page: `/?token=TOKEN` sets the session cookie
SESSION_COOKIE = b"kvindex_session"
SESSION_PATH = "/v1/dashboard/"  # where the cookie is sent, and the only paths it opens
_OLD_COOKIE = b"kvindex_token"  # what earlier versions' page set (the token itself, path /)


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


def session_value(token: bytes) -> bytes:
    """What the dashboard's cookie holds: a value derived from the token, which opens the
    dashboard's paths only and never gives the token away."""
    return hmac.new(token, b"kvindex dashboard session", hashlib.sha256).hexdigest().encode()


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers") or ():
        if name == wanted:
            return bytes(value)
    return None


_FLEET_PATHS = frozenset({"/register", "/unregister"})
_INSTANCES = "/v1/instances"
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
FLEET_CHANGES_OFF = "fleet changes are turned off here (serve --no-fleet-changes)"
NEEDS_ADMIN = (
    "changing the fleet needs the admin token (serve --admin-token); the query token "
    "reads and looks up only"
)


def changes_fleet(method: str, path: str) -> bool:
    """Whether a request adds or removes instances: `POST`/`DELETE` under `/v1/instances`,
    the peers' `/register` and `/unregister` (any method: none of theirs only reads)."""
    if path.rstrip("/") in _FLEET_PATHS:
        return True
    if path == _INSTANCES or path.startswith(_INSTANCES + "/"):
        return method.upper() not in _READ_METHODS
    return False


@dataclass(frozen=True, slots=True)
class Access:
    """How a request is judged: the tokens any one of which opens it (none and no `lesser`:
    open to all), the tokens that are valid but not enough (a 403), and a refusal for
    everyone (a 403 to a valid token, a 401 to the others when any token is set)."""

    tokens: tuple[bytes, ...] = ()
    lesser: tuple[bytes, ...] = ()
    refused: str | None = None

    def verdict(self, given: bytes | None) -> tuple[int, str] | None:
        """The refusal (status, message) of a request bearing `given`, or None: it passes."""
        if self.refused is None and not self.tokens and not self.lesser:
            return None
        if self.tokens and given is not None and _matches(given, self.tokens):
            return None if self.refused is None else (403, self.refused)
        if given is not None and self.lesser and _matches(given, self.lesser):
            return 403, self.refused or NEEDS_ADMIN
        if not self.tokens and not self.lesser:
            return 403, self.refused or NEEDS_ADMIN
        return 401, "a bearer token is required" if given is None else "invalid bearer token"


@dataclass(frozen=True, slots=True)
class AccessRules:
    """Which token opens which request: the query token (reads and lookups), the metrics
    token (`/metrics`), the admin token (everything, and the only one that changes the
    fleet), and whether the fleet may be changed over HTTP at all."""

    token: bytes | None = None
    metrics_token: bytes | None = None
    admin_token: bytes | None = None
    fleet_changes: bool = True

    @classmethod
    def of(
        cls,
        token: str | None,
        metrics_token: str | None = None,
        admin_token: str | None = None,
        fleet_changes: bool = True,
    ) -> AccessRules:
        def raw(value: str | None) -> bytes | None:
            return value.encode() if value else None

        return cls(raw(token), raw(metrics_token), raw(admin_token), fleet_changes)

    @property
    def guards(self) -> bool:
        """Whether any request can be refused (else the middleware has nothing to do)."""
        return bool(self.token or self.metrics_token or self.admin_token or not self.fleet_changes)

    def judge(self, method: str, path: str) -> Access:
        if changes_fleet(method, path):
            configured = tuple(
                t for t in (self.admin_token, self.token, self.metrics_token) if t is not None
            )
            if not self.fleet_changes:
                return Access(lesser=configured, refused=FLEET_CHANGES_OFF)
            if self.admin_token is not None:
                return Access((self.admin_token,), configured[1:])
            if self.token is not None:
                return Access(lesser=configured, refused=NEEDS_ADMIN)
            return Access()
        return Access(self._read_tokens(path))

    def _read_tokens(self, path: str) -> tuple[bytes, ...]:
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return ()
        if path == METRICS_PATH:
            if self.metrics_token is None:
                return ()
            wanted: tuple[bytes | None, ...] = (self.metrics_token, self.token, self.admin_token)
        elif self.token is None:
            return ()
        else:
            wanted = (self.token, self.admin_token)
        return tuple(t for t in wanted if t is not None)


def _bearer(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer` header; b"" for another scheme (refused)."""
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, credentials = value.partition(b" ")
    if scheme.lower() == b"bearer" and credentials.strip():
        return credentials.strip()
    return b""


def _session_cookie(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers") or ():
        if name != b"cookie":
            continue
        for part in bytes(value).split(b";"):
            key, _, found = part.strip().partition(b"=")
            if key == SESSION_COOKIE and found:
                return unquote_to_bytes(found)
    return None


def _query_token(scope: Scope) -> tuple[str | None, list[tuple[str, str]]]:
    """The `token` of the query string, and the rest of it."""
    pairs = parse_qsl(bytes(scope.get("query_string") or b"").decode("latin-1"), True)
    token = next((value for key, value in pairs if key == "token"), None)
    return token, [(key, value) for key, value in pairs if key != "token"]


def _matches(given: bytes, tokens: tuple[bytes, ...] | list[bytes]) -> bool:
    # Every token is compared (no early exit), each in constant time.
    found = False
    for token in tokens:
        found |= hmac.compare_digest(given, token)
    return found


_CHALLENGE = [(b"www-authenticate", b'Bearer realm="kvindex"')]


class BearerAuth:
    """Requires `Authorization: Bearer ...` (see the module docstring for which paths and
    which token), or under `/v1/dashboard/` the dashboard's session cookie."""

    def __init__(self, app: ASGIApp, rules: AccessRules) -> None:
        self.app = app
        self.rules = rules
        self.token = rules.token
        self.session = session_value(self.token) if self.token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path == LOGIN_PATH and self.token is not None:
            token, rest = _query_token(scope)
            if token is not None:
                await self._start_session(scope, send, token.encode(), rest)
                return
        access = self.rules.judge(scope.get("method", "GET"), path)
        given = _bearer(scope)
        if given is None and path.startswith(SESSION_PATH) and self.session is not None:
            given = _session_cookie(scope)
            if given is not None:  # the cookie opens the dashboard's paths, no more
                access = Access((self.session,)) if access.tokens else access
        refusal = access.verdict(given)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, why = refusal
        await error_response(send, status, why, _CHALLENGE if status == 401 else None)

    async def _start_session(
        self, scope: Scope, send: Send, token: bytes, rest: list[tuple[str, str]]
    ) -> None:
        """`/?token=TOKEN`: the dashboard's cookie, and the page again without the token in
        the address bar (a 303); a wrong token is a 401."""
        assert self.token is not None and self.session is not None
        if not _matches(token, [self.token]):
            await error_response(send, 401, "invalid token", _CHALLENGE)
            return
        secure = b"; Secure" if scope.get("scheme") in ("https", "wss") else b""
        cookie = (
            SESSION_COOKIE + b"=" + self.session + b"; Path=" + SESSION_PATH.encode()
            + b"; HttpOnly; SameSite=Strict" + secure
        )  # fmt: skip
        # Earlier versions' page kept the token itself in a cookie for the whole host.
        expire_old = _OLD_COOKIE + b"=; Path=/; Max-Age=0; SameSite=Strict" + secure
        location = LOGIN_PATH + ("?" + urlencode(rest) if rest else "")
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode()),
                    (b"set-cookie", cookie),
                    (b"set-cookie", expire_old),
                    (b"cache-control", b"no-store"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The Host names served by default: `localhost`, and the name serve is bound to; with
    a wildcard bind (0.0.0.0, ::), the machine's own names. IP literals always pass."""
    names = {"localhost"}
    if bind_host in ("", "0.0.0.0", "::"):
        names |= {socket.gethostname(), socket.getfqdn()}
    elif not _is_ip(bind_host):
        names.add(bind_host)
    return sorted(name.lower().rstrip(".") for name in names if name)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_name(header: bytes) -> str:
    """The host of a `Host` header, without its port, lowercase, no trailing dot."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    name, sep, port = text.rpartition(":")
    return (name if sep and port.isdigit() else text).rstrip(".")


class HostNames:
    """The Host names served (`*`: every name); IP literals always are."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = frozenset(name.lower().rstrip(".") for name in allowed)
        self.any = "*" in self.allowed

    def refused(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The host name of a request that is not served, or None if it is."""
        if self.any:
            return None
        header = _header({"headers": headers}, b"host")
        host = _host_name(header) if header is not None else None
        if host is None or host in self.allowed or _is_ip(host):
            return None
        return host


class HostAllowList:
    """Refuses a request whose `Host` is a name not on the list (see the module
    docstring); `*` on the list lets every name through."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.names = HostNames(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.names.any:
            await self.app(scope, receive, send)
            return
        host = self.names.refused(scope.get("headers") or [])
        if host is None:
            await self.app(scope, receive, send)
            return
        await error_response(
            send,
            400,
            f"Host {host!r} is not served here (a DNS-rebound name?): add it to serve's "
            "--allowed-hosts (server.allowed_hosts) if it is yours",
        )


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


@functools.lru_cache(maxsize=8)
def _host_names(allowed: tuple[str, ...]) -> HostNames:
    return HostNames(allowed)


@dataclass(frozen=True, slots=True)
class HttpGuard:
    """The API's access rules and limits (`kvindex serve --token ...`)."""

    token: str | None = None
    metrics_token: str | None = None
    max_lookup_items: int = 1_000_000  # token ids (or block hashes) in one lookup
    request_timeout: float = 30.0  # for a request's body to arrive
    # Host names served (IP literals always are); None: no check (an app in a test, or
    # behind a proxy that checks). serve passes `default_allowed_hosts` and the operator's.
    allowed_hosts: tuple[str, ...] | None = None
    admin_token: str | None = None  # the only token that changes the fleet
    fleet_changes: bool = True  # False: no request adds or removes instances (403)
    max_streams: int = 32  # dashboard event streams open at once (503 past it)

    @property
    def rules(self) -> AccessRules:
        return _rules(self.token, self.metrics_token, self.admin_token, self.fleet_changes)

    def admits(self, path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> bool:
        """Whether a request passes every rule that needs no body (its Host, its token), as
        the middleware would judge it. A path that answers outside the ASGI stack
        (kvindex.service.fastpath) asks this, and leaves a request it refuses to the stack,
        which words the refusal: a rule added to the middleware belongs here too."""
        if self.allowed_hosts is not None and _host_names(self.allowed_hosts).refused(headers):
            return False
        access = self.rules.judge(method, path)
        return access.verdict(_bearer({"headers": headers})) is None

    def asks_token(self, path: str, method: str = "GET") -> bool:
        """Whether a request for `path` must carry a token (where the API documents 401)."""
        return bool(self.rules.judge(method, path).tokens)

    def refuses(self, path: str, method: str) -> bool:
        """Whether a request is refused whatever its token (where the API documents 403):
        a fleet change with fleet changes off, or with a query token and no admin token."""
        access = self.rules.judge(method, path)
        return access.refused is not None or bool(access.lesser)

    def install(self, app: Any) -> None:
        """Add the middleware to a Starlette/FastAPI app (outermost: the Host check, auth,
        then the body deadline), and document the bearer scheme in its OpenAPI."""
        app.add_middleware(RequestDeadline, timeout=self.request_timeout)
        rules = self.rules
        if rules.guards:
            app.add_middleware(BearerAuth, rules=rules)
        if self.allowed_hosts is not None:
            app.add_middleware(HostAllowList, allowed=self.allowed_hosts)
        if self.token or self.admin_token:
            _document_bearer(app)


@functools.lru_cache(maxsize=8)
def _rules(
    token: str | None, metrics_token: str | None, admin_token: str | None, fleet_changes: bool
) -> AccessRules:
    return AccessRules.of(token, metrics_token, admin_token, fleet_changes)


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
