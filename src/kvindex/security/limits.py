"""Limits before the token: what one client can make the HTTP front hold before any rule
of the API (the Host check, the token) has looked at its request.

uvicorn's httptools protocol parses a request's head with no size limit (an 8 MB header
line, 200,000 headers, a 200 MB header streamed on one connection: all parsed, and held,
before the 401), no deadline for the head to arrive (a half-sent head holds its connection
for ever) and, left to itself, no cap on connections. `LimitedProtocol` is that protocol
with them, the base of the service's own (kvindex.service.fastpath.LookupProtocol):

| limit | default | past it |
| --- | --- | --- |
| `max_header_bytes`: request line and headers | 64 KiB | 431, closed |
| `header_timeout`: from a request's first byte to its end | 10 s | 408, closed |
| `max_connections`: HTTP connections open at once, the lookup thread's too | 1000 | 503, closed |
| `tls_handshake_timeout`: a TLS handshake (`--tls-cert`) | 10 s | closed |

Bytes are counted as they arrive, before the parser keeps them: a head over the limit is
refused once the limit's worth is in, never buffered whole. Between two requests of a
keep-alive connection, uvicorn's keep-alive timeout (5 s) bounds the wait; a pipelined
request's head is counted from the read after the one its predecessor ended in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["LimitedProtocol", "Limits", "limited_protocol"]


@dataclass(frozen=True, slots=True)
class Limits:
    """The HTTP front's limits (see the module docstring); serve's flags set them."""

    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    max_connections: int = 1000
    tls_handshake_timeout: float = 10.0


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` (a class attribute: `limited_protocol`
    makes a class with the service's own) applied before any request reaches the app."""

    limits: Limits = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the connection ------------------------------------------------------------------

    def held_elsewhere(self) -> int:
        """Connections the service holds outside this protocol's server (the C lookup
        thread's, kvindex.service.lookupd), counted against `max_connections` too."""
        return 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Each answer goes out at once, whatever is unacknowledged: asyncio sets it only on
        # a socket whose protocol number says TCP (not one made by `socket.socket()`), and
        # without it an answer's last segment waits for the client's delayed ACK (40 ms).
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) + self.held_elsewhere() > self.limits.max_connections:
            self._refuse(503, f"over {self.limits.max_connections} connections: try again later")
            return
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.transport.is_closing():
            return
        if not self._reading_head():
            super().data_received(data)
            self._watch_head()
            return
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            self._watch_head()
            return
        head, rest = data[:room], data[room:]  # the limit's worth only reaches the parser
        self._head_bytes += len(head)
        super().data_received(head)
        if self.transport.is_closing():
            return
        if self._reading_head():
            self._refuse(431, f"request line and headers over {self.limits.max_header_bytes} bytes")
            return
        self._watch_head()
        self.data_received(rest)

    # -- the head ------------------------------------------------------------------------

    def _reading_head(self) -> bool:
        """Whether the parser is in a request's line or headers (or before the first):
        uvicorn's (and the fast path's) header handling sets the scope's method."""
        scope: Any = self.scope
        return scope is None or "method" not in scope

    def _watch_head(self) -> None:
        """A head being read runs its deadline; one read ends it (and its byte count)."""
        if self._reading_head():
            if self._head_timer is None and not self.transport.is_closing():
                timeout = self.limits.header_timeout
                self._head_timer = self.loop.call_later(timeout, self._head_too_slow)
            return
        self._stop_head_timer()
        self._head_bytes = 0

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head():
            return
        cycle: Any = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined head behind an answer still being written: its turn comes later.
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_too_slow)
            return
        if self._head_bytes == 0:
            self.transport.close()  # nothing of a request came: nothing to answer
            return
        self._refuse(408, f"request headers not received in {self.limits.header_timeout:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with the API's error shape and close: the rest of what the
        client sends is never read."""
        self._stop_head_timer()
        body = json.dumps({"error": message}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\n",
            b"connection: close\r\n",
        ]  # fmt: skip
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


def limited_protocol(limits: Limits, base: type[LimitedProtocol] = LimitedProtocol) -> type[Any]:
    """A protocol class (`uvicorn.Config(http=...)`) holding `limits`."""
    return type(f"Limited{base.__name__}", (base,), {"limits": limits})
