"""A KV-aware router: an OpenAI-compatible proxy in front of a vLLM fleet that sends each
request to the engine kvindex says already holds its prefix.

    python examples/kv_router.py --kvindex http://127.0.0.1:8080 \\
        --engine vllm-0=http://10.0.0.5:8000 --engine vllm-1=http://10.0.0.6:8000

Each `--engine NAME=URL` is an engine's OpenAI server, NAME its instance name in kvindex
(`kvindex serve --instance NAME=tcp://...,model=MODEL --tokenizer MODEL=...`). For every
`POST /v1/completions` and `/v1/chat/completions` the proxy asks kvindex's `POST /v1/route`
with the request's prompt (text or token ids) or messages, its model and cache salt; kvindex
tokenizes, scores prefix and load, and records the choice as predicted blocks so that a
burst with the same new prefix stays together. The request is then forwarded unchanged
(streamed answers too) to the chosen engine. If kvindex can't answer, the proxy falls back
to round robin. The `x-kvindex-instance` and `x-kvindex-route` headers of each answer say
where it went and why (docs/routing.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def route_body(request: dict[str, Any]) -> dict[str, Any] | None:
    """kvindex's `/v1/route` body for an OpenAI request (None: nothing to route on)."""
    body: dict[str, Any] = {}
    prompt = request.get("prompt")
    if isinstance(request.get("messages"), list):
        body["messages"] = request["messages"]
    elif isinstance(prompt, str):
        body["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        body["token_ids"] = prompt
    else:
        return None  # a batch of prompts: any engine will do
    for key in ("model", "cache_salt"):
        if isinstance(request.get(key), str):
            body[key] = request[key]
    return body


def create_proxy(kvindex: str, engines: dict[str, str]) -> Starlette:
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
    turns = itertools.cycle(sorted(engines))

    async def choose(request: dict[str, Any]) -> tuple[str, str]:
        """(engine name, why): kvindex's choice, else the next one in turn."""
        body = route_body(request)
        if body is None:
            return next(turns), "round robin: no single prompt"
        try:
            answer = await client.post(f"{kvindex}/v1/route", json=body)
        except httpx.HTTPError as exc:
            return next(turns), f"round robin: kvindex unreachable ({type(exc).__name__})"
        if answer.status_code != 200:
            return next(turns), f"round robin: kvindex {answer.status_code}"
        best = str(answer.json()["best"])
        if best not in engines:
            return next(turns), f"round robin: no --engine for {best}"
        return best, "kvindex"

    async def forward(request: Request) -> Response:
        raw = await request.body()
        try:
            parsed = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, 400)
        if not isinstance(parsed, dict):
            return JSONResponse({"error": "the body is not a JSON object"}, 400)
        name, why = await choose(parsed)
        upstream = client.build_request(
            "POST",
            engines[name] + request.url.path,
            content=raw,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"engine {name}: {exc!r}"}, 502)
        headers = {"x-kvindex-instance": name, "x-kvindex-route": why}
        kind = reply.headers.get("content-type", "application/json")
        return StreamingResponse(
            reply.aiter_raw(),
            reply.status_code,
            headers,
            media_type=kind,
            background=BackgroundTask(reply.aclose),
        )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "engines": sorted(engines)})

    return Starlette(
        routes=[
            Route("/v1/completions", forward, methods=["POST"]),
            Route("/v1/chat/completions", forward, methods=["POST"]),
            Route("/health", health),
        ],
        lifespan=lambda app: _closing(client),
    )


@contextlib.asynccontextmanager
async def _closing(client: httpx.AsyncClient) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvindex", default="http://127.0.0.1:8080", help="kvindex's URL")
    parser.add_argument("--engine", action="append", required=True, metavar="NAME=URL")
    parser.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    args = parser.parse_args()
    engines = dict(e.split("=", 1) for e in args.engine if "=" in e)
    if len(engines) != len(args.engine):
        parser.error("--engine must be NAME=URL")
    host, _, port = args.listen.rpartition(":")
    proxy = create_proxy(args.kvindex.rstrip("/"), {k: v.rstrip("/") for k, v in engines.items()})
    uvicorn.run(proxy, host=host, port=int(port), log_level="warning")


if __name__ == "__main__":
    main()
