"""`POST /v1/lookup`, the one path paid at a router's request rate, answered short.

Through FastAPI a 512-block lookup over 64 instances cost ~430 us in the process:
~200 us to decode 8,192 token ids into Python ints, ~170 us to build the answer's rows and
statuses in Python, ~40 us of routing and request objects. Here the body is read straight
into uint32 token ids in C (`parse_lookup_body`) and the whole answer is written as JSON
in C from the walk (`Fleet.lookup_json`): ~80 us. Two ways in:

- `LookupFastPath`, an ASGI middleware innermost in the app (inside the guards: it sees a
  request only once they passed it, and reads the body through them). Any ASGI server.
- `lookup_protocol`, for `kvindex serve`: uvicorn's own HTTP protocol, which answers a
  plain lookup as soon as its body is in, with no ASGI task, middleware or second write
  (uvicorn's ASGI machinery costs ~45 us a request here, FastAPI's stack ~80 more: more
  than the lookup itself). It asks the guard (`HttpGuard.admits`), checks the body limit
  and deadline itself, and hands anything else to the ASGI app as uvicorn would.

Both answer only a body of the plain shape; anything else (not JSON, an unknown field, a
token id past 32 bits, `1.0`, an escaped string, a refused token...) goes to the FastAPI
route with the same body, which decides: every refusal keeps its one wording and status.

`POST /v1/lookup/hashes` takes the same ways in; its body is decoded and its answer
encoded by msgspec (a router asking by hash sends few of them), and only the ASGI stack
around it is saved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvindex.index import parse_lookup_body
from kvindex.runtime import Fleet
from kvindex.security.http import ASGIApp, HttpGuard, Message, Receive, Scope, Send, error_response
from kvindex.security.limits import LimitedProtocol, Limits
from kvindex.service.metrics import ServiceMetrics
from kvindex.service.schema import BadBody, HashLookupRequest, decode_body, encode
from kvindex.wire import parse_hash

__all__ = ["LookupAnswerer", "LookupFastPath", "LookupProtocol", "OneWrite", "lookup_protocol"]

PATH = "/v1/lookup"
HASHES_PATH = "/v1/lookup/hashes"
PATHS = {PATH, HASHES_PATH}
_RAW_PATHS = {path.encode(): path for path in PATHS}
_JSON = b"content-type: application/json\r\n"

log = logging.getLogger(__name__)


class LookupAnswerer:
    """A plain lookup body's answer (JSON), or None for the route to decide."""

    def __init__(self, fleet: Fleet, metrics: ServiceMetrics, max_items: int) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.max_items = max_items

    def answer(self, path: str, body: bytes) -> bytes | None:
        if path == HASHES_PATH:
            return self._by_hashes(body)
        parsed = parse_lookup_body(body, self.max_items)
        if parsed is None:
            return None
        tokens, lora_name, cache_salt = parsed
        start = time.perf_counter()
        answer, hit = self.fleet.lookup_json(tokens, lora_name, cache_salt)
        self.metrics.lookups.observe("tokens", time.perf_counter() - start, hit, compiled=True)
        return answer

    def _by_hashes(self, body: bytes) -> bytes | None:
        try:
            request: HashLookupRequest = decode_body(body, HashLookupRequest)
            if len(request.block_hashes) > self.max_items:
                return None
            hashes = [parse_hash(text) for text in request.block_hashes]
        except (BadBody, ValueError):
            return None  # the route words the refusal
        start = time.perf_counter()
        answer = self.fleet.lookup_hashes(hashes)
        self.metrics.lookups.observe("hashes", time.perf_counter() - start, answer.hit)
        return encode(answer)


# -- in the ASGI app ----------------------------------------------------------------------


class LookupFastPath:
    """Answers plain `POST /v1/lookup` bodies itself; hands every other request on."""

    def __init__(self, app: ASGIApp, answerer: LookupAnswerer) -> None:
        self.app = app
        self.answerer = answerer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            messages = await _read_body(receive)
        except HTTPException as exc:  # over the body limit, while it arrived
            await error_response(send, exc.status_code, str(exc.detail))
            return
        body = b"".join(m.get("body", b"") for m in messages)
        answer = self.answerer.answer(scope["path"], body)
        if answer is None:  # not the plain shape: the route decides
            await self.app(scope, _replay(messages, receive), send)
            return
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


async def _read_body(receive: Receive) -> list[Message]:
    """The request's body messages, as they came (a disconnect ends them)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that gives `messages` again, then the real one's (a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


# -- in uvicorn's protocol ---------------------------------------------------------------


class _Collecting:
    """Stands in for uvicorn's RequestResponseCycle while a lookup body arrives: what
    HttpToolsProtocol's callbacks read and write of a cycle (body, message_event, ...)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.body = bytearray()
        self.more_body = True
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True
        self.message_event = asyncio.Event()
        self.deadline: asyncio.TimerHandle | None = None


def lookup_protocol(
    answerer: LookupAnswerer,
    guard: HttpGuard,
    max_body_bytes: int,
    limits: Limits | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (`uvicorn.Config(http=...)`) with plain lookups
    answered in it (see the module docstring), under the front's `limits`
    (kvindex.security.limits: header size and deadline, connections)."""
    parts = {
        "answerer": answerer,
        "guard": guard,
        "max_body_bytes": max_body_bytes,
        "limits": limits or Limits(),
    }
    return type("ServiceLookupProtocol", (LookupProtocol,), parts)


class OneWrite:
    """A response cycle's transport (uvicorn's `RequestResponseCycle.transport`) that
    writes two writes made in one step of the loop as one: uvicorn writes an ASGI
    answer's head and body apart, two segments where one would do (the client woken twice;
    and a client whose peer lacked TCP_NODELAY would wait on its delayed ACK for the
    second). A write is held until the next, which goes with it; one left alone goes at
    the loop's next turn (a streamed answer's head, waiting for its first chunk), at
    `flush` (the protocol calls it as the response completes) or before a `close`."""

    __slots__ = ("_handle", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._handle: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = bytes(data)
            if self._handle is None:
                self._handle = self._loop.call_soon(self.flush)
            return
        self._held = None
        self._transport.write(held + data)

    def flush(self) -> None:
        """What is held, written now."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # the rest is the transport's
        return getattr(self._transport, name)


class LookupProtocol(LimitedProtocol):
    """uvicorn's httptools protocol with plain lookups answered in it, on the front's
    limits (LimitedProtocol: a head is bounded in size and time before it gets here);
    `lookup_protocol` makes one for a service (its answerer, guard, body limit and limits
    as class attributes). The other answers (the ASGI app's) go out in one write
    (`OneWrite`)."""

    answerer: LookupAnswerer
    guard: HttpGuard
    max_body_bytes: int

    def on_headers_complete(self) -> None:
        if not self._takes_lookup():
            super().on_headers_complete()
            self._one_write()
            return
        cycle = _Collecting(_RAW_PATHS[self.url])
        cycle.deadline = self.loop.call_later(self.guard.request_timeout, self._too_slow, cycle)
        self.scope["method"] = "POST"
        self.cycle = cycle  # type: ignore[assignment]

    def _takes_lookup(self) -> bool:
        """A plain lookup: nothing of it the ASGI stack would answer otherwise."""
        parser = self.parser
        path = _RAW_PATHS.get(self.url)
        if path is None or parser.get_method() != b"POST":
            return False
        if parser.get_http_version() != "1.1" or not parser.should_keep_alive():
            return False
        if self.expect_100_continue or self.root_path or self.limit_concurrency is not None:
            return False
        previous = self.cycle
        if previous is not None and not previous.response_complete:
            return False  # pipelined behind an answer in progress: uvicorn queues it
        return _length_within(self.headers, self.max_body_bytes) and self.guard.admits(
            path, self.headers
        )

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if not isinstance(cycle, _Collecting):
            super().on_body(body)
        elif not cycle.response_complete:  # bounded by the Content-Length checked
            cycle.body += body

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        if isinstance(cycle, _Collecting) and cycle.deadline is not None:
            cycle.deadline.cancel()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if not isinstance(cycle, _Collecting):
            super().on_message_complete()
            return
        if cycle.response_complete:
            return
        if cycle.deadline is not None:
            cycle.deadline.cancel()
        body = bytes(cycle.body)
        try:
            answer = self.answerer.answer(cycle.path, body)
        except Exception:  # httptools would make it a 400 "Invalid HTTP request"
            log.exception("%s failed", cycle.path)
            self._respond(cycle, 500, b'{"error":"internal error"}', close=False)
            return
        if answer is None:  # the route decides, as if uvicorn had read it itself
            self._to_the_app(body)
            return
        self._respond(cycle, 200, answer, close=False)

    def _to_the_app(self, body: bytes) -> None:
        self.cycle = None  # type: ignore[assignment]
        super().on_headers_complete()
        self._one_write()
        super().on_body(body)
        super().on_message_complete()

    def _one_write(self) -> None:
        """The ASGI cycle just made writes its answer's head with its body."""
        cycle: Any = self.cycle
        if cycle is not None and not isinstance(cycle, _Collecting):
            cycle.transport = OneWrite(self.transport, self.loop)

    def on_response_complete(self) -> None:
        # the answer's last bytes written before anything else (the keep-alive, the next
        # pipelined request, the lookup thread taking the connection back)
        transport: Any = getattr(self.cycle, "transport", None)
        if isinstance(transport, OneWrite):
            transport.flush()
        super().on_response_complete()

    def _too_slow(self, cycle: _Collecting) -> None:
        """The body did not arrive in time: 408, as the ASGI stack's deadline says it,
        and the connection closed (the rest of the body would read as a request)."""
        current: object = self.cycle
        if current is cycle and not cycle.response_complete:
            if self.transport.is_closing():
                return
            message = f"request body not received in {self.guard.request_timeout} s"
            body = b'{"error":"' + message.encode() + b'"}'
            self._respond(cycle, 408, body, close=True)

    def _respond(self, cycle: _Collecting, status: int, body: bytes, close: bool) -> None:
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [_JSON, b"content-length: ", str(len(body)).encode(), b"\r\n"]
        close = close or not cycle.keep_alive  # a graceful shutdown is under way
        if close:
            head.append(b"connection: close\r\n")
        head += [b"\r\n", body]
        self.transport.write(b"".join(head))  # one write: one segment, one wakeup
        cycle.response_complete = True
        if close:
            self.transport.close()
            return
        self.on_response_complete()


def _length_within(headers: list[tuple[bytes, bytes]], limit: int) -> bool:
    """One declared Content-Length, within the limit; anything else (a chunked body, two
    lengths) is the stack's to judge."""
    lengths = [value for name, value in headers if name == b"content-length"]
    if len(lengths) != 1 or any(name == b"transfer-encoding" for name, _ in headers):
        return False
    return lengths[0].isdigit() and int(lengths[0]) <= limit
