"""The HTTP API's own middleware, as plain ASGI (on security/http.py's types):

- `BodyLimit`: a request body over the limit is refused (413) before anything parses it;
- `LookupPriority`: counts lookups in flight (`Fleet.urgent`), so work that can wait
  yields to a router waiting for an answer;
- `CompleteAllow`: a 405 lists every method the path takes (Starlette's router names
  only the methods of the first route that matched the path: `GET /v1/instances` and
  `POST /v1/instances` are two routes).

Every refusal is the API's one error shape, `{"error": "..."}`.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Route

from kvindex.runtime import Fleet
from kvindex.security.http import ASGIApp, Message, Receive, Scope, Send, error_response

__all__ = ["BodyLimit", "CompleteAllow", "LookupPriority"]


class BodyLimit:
    """Refuses request bodies over `limit` bytes (413) before anything parses them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = f"request body over {self.limit} bytes"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await error_response(send, 413, why)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # answered 413 by the app's handler of HTTPException
                raise HTTPException(413, why)
            return message

        await self.app(scope, counted, send)


class LookupPriority:
    """Counts lookups in flight in `Fleet.urgent`."""

    def __init__(self, app: ASGIApp, fleet: Fleet) -> None:
        self.app = app
        self.fleet = fleet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/lookup"):
            await self.app(scope, receive, send)
            return
        self.fleet.urgent += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.fleet.urgent -= 1


class CompleteAllow:
    """Rewrites the `Allow` header of a 405 to every method of every route of the path."""

    def __init__(self, app: ASGIApp, routes: Callable[[], list[BaseRoute]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def completed(message: Message) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 405:
                allow = ", ".join(sorted(self._methods(scope))).encode()
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", allow)]}
            await send(message)

        await self.app(scope, receive, completed)

    def _methods(self, scope: Scope) -> set[str]:
        methods: set[str] = set()
        for route in self.routes():
            if isinstance(route, Route) and route.methods:
                match, _ = route.matches(scope)
                if match is not Match.NONE:
                    methods |= route.methods
        return methods
