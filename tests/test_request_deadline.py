"""The request-body deadline must not cut a streaming response (the dashboard's SSE)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvindex.security.http import RequestDeadline


def test_deadline_applies_to_the_body_only() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the (complete) body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):  # longer than the deadline, listening for a disconnect meanwhile
            try:
                await asyncio.wait_for(receive(), 0.1)
            except TimeoutError:
                pass
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        if not sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(RequestDeadline(app, timeout=0.15)({"type": "http"}, receive, send))
    assert [m.get("body") for m in sent[1:]] == [b"x", b"x", b"x", b""]


def test_slow_body_gets_408() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(RequestDeadline(app, timeout=0.05)({"type": "http"}, receive, send))
    assert sent[0]["status"] == 408
