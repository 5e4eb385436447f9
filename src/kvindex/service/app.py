"""The HTTP API of `kvindex serve` (see docs/configuration.md and the OpenAPI document at
/openapi.json), as a FastAPI app.

Every request and answer is a msgspec struct of `kvindex.service.schema`, which also makes
the OpenAPI document: bodies are decoded by msgspec and answers encoded straight into a
`Response` (a block list can hold millions of hashes, and a lookup should cost
microseconds, not a model validation). Errors are always `{"error": "..."}`; bad input
never gets a 500.

`create_app` is the one place the app is composed: routes, error handlers, the dashboard,
the docs, then the middleware (see kvindex.service.middleware and kvindex.security.http).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kvindex.runtime import (
    DuplicateInstance,
    Fleet,
    LookupAnswer,
    StoreHealth,
    UnknownInstance,
    WorkerUnavailable,
)
from kvindex.runtime.discovery import first_read
from kvindex.runtime.finders import Reconciler
from kvindex.runtime.routing import RouteAnswer
from kvindex.security.http import HttpGuard
from kvindex.service.dashboard import install_dashboard
from kvindex.service.docs import install_docs
from kvindex.service.fastpath import LookupAnswerer, LookupFastPath
from kvindex.service.lookups import (
    Routing,
    decode_any_lookup,
    install_doctor,
    install_route,
    lookup_answer,
)
from kvindex.service.metrics import ServiceMetrics
from kvindex.service.middleware import BodyLimit, CompleteAllow, LookupPriority
from kvindex.service.peers import install_peers
from kvindex.service.schema import (
    MAX_LOOKUP_ITEMS,
    AddInstanceByFields,
    AddInstanceBySpec,
    BadBody,
    BlocksAnswer,
    ChatLookupRequest,
    ErrorAnswer,
    HashLookupRequest,
    HealthAnswer,
    InstanceAnswer,
    InstancesAnswer,
    LookupRequest,
    PromptLookupRequest,
    decode_body,
    encode,
    error_body,
    instance_answer,
    json_content,
    mm_keys,
    operation_doc,
    ref,
    schema_components,
    spec_of,
)
from kvindex.subscriber import CapacityError, InstanceSpec, SpecError
from kvindex.subscriber.server_info import DiscoveryError
from kvindex.wire import parse_hash, render_hash

__all__ = ["MAX_BODY_BYTES", "MAX_LOOKUP_ITEMS", "create_app"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # a lookup of a million ids is ~8 MB of JSON


# -- answers ---------------------------------------------------------------------------


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(encode(content), status_code, media_type="application/json")


def _error(status_code: int, message: str) -> Response:
    return Response(error_body(message), status_code, media_type="application/json")


def _first_read(spec: InstanceSpec) -> InstanceSpec:
    """The engine's publishers if its /server_info answers now; the spec as it is (left to
    be found, `connecting`) if the engine is down; `DiscoveryError` for a mistake of
    setup (no KV events, an API key refused), which the caller must hear about."""
    try:
        return first_read(spec, timeout=2.0)
    except DiscoveryError as exc:
        if exc.failure.is_setup:
            raise
        return spec


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# -- the app ---------------------------------------------------------------------------


def create_app(
    fleet: Fleet,
    *,
    manage_fleet: bool = True,
    max_body_bytes: int = MAX_BODY_BYTES,
    guard: HttpGuard | None = None,
    store_health: Callable[[], StoreHealth] | None = None,
    routing: Routing | None = None,
    finders: Reconciler | None = None,
) -> FastAPI:
    """The API over `fleet`. With `manage_fleet`, the app's lifespan starts its ingest in
    the server's loop and stops it (closing the sockets) at shutdown. `guard` sets bearer
    tokens, the lookup size limit and the request body deadline; `store_health` says how
    the state store is doing (for /healthz, /v1/stats and /metrics); `routing` the
    tokenizers, routing weights and predictions (kvindex.service.lookups); `finders` the
    --discover finders (started and stopped with the app), their history and start gate."""
    guard = guard or HttpGuard()
    routing = routing or Routing.of(fleet)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_fleet:
            await fleet.start()
        routing.scraper.start()  # the engines' /metrics: load for the score
        if finders is not None:  # --discover: they add instances, so once ingest runs
            finders.start()
        try:
            yield
        finally:
            if finders is not None:
                await asyncio.to_thread(finders.stop)
            routing.scraper.stop()
            await routing.tokenizers.aclose()
            if manage_fleet:
                await fleet.stop()

    app = FastAPI(
        title="kvindex",
        summary="An exact index of vLLM's KV-cache events: per-instance blocks and lookups.",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,  # served offline by install_docs, not from a CDN
        redoc_url=None,
    )
    health = store_health or _no_store
    metrics = ServiceMetrics(
        fleet, health, routing.scraper, routing.tokenizers.cache_stats, finders=finders
    )
    app.state.fleet = fleet
    app.state.metrics = metrics
    app.state.max_lookup_items = guard.max_lookup_items
    _add_error_handlers(app)
    _add_routes(app, fleet, metrics, health, finders)
    route_doc = operation_doc(
        RouteAnswer,
        body=[LookupRequest, PromptLookupRequest, ChatLookupRequest],
        errors=[400, 404, 409, 413, 422, 502, 503],
    )
    install_route(app, routing, metrics, route_doc)
    install_doctor(app, routing, metrics)
    install_peers(app, routing, metrics)
    # GET /, its assets, /v1/dashboard/*
    install_dashboard(app, fleet, routing.scraper, guard.max_streams)
    install_docs(app)  # GET /docs and its assets
    _document(app, guard)
    # Innermost first: plain lookups answered past the guards, ahead of the routing; Allow
    # completed on a 405, bodies bounded, then the guard (bad tokens refused before any
    # body is read), and lookups counted from the start.
    answerer = LookupAnswerer(fleet, metrics, guard.max_lookup_items)
    app.state.lookup_answerer = answerer  # for `serve`'s protocol (fastpath.lookup_protocol)
    app.add_middleware(LookupFastPath, answerer=answerer)
    app.add_middleware(CompleteAllow, routes=lambda: app.routes)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    guard.install(app)
    app.add_middleware(LookupPriority, fleet=fleet)
    return app


def _limit(request: Request) -> int:
    limit: int = request.app.state.max_lookup_items
    return limit


def _check_items(request: Request, count: int, what: str) -> None:
    limit = _limit(request)
    if count > limit:
        raise BadBody(422, f"{what} has {count} items, over the limit of {limit}")


def _version() -> str:
    from kvindex import __version__

    return __version__


def _add_error_handlers(app: FastAPI) -> None:
    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error(422, _validation_message(exc))

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = _error(exc.status_code, str(exc.detail))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def internal(request: Request, exc: Exception) -> Response:
        if _quotes_headers(exc):  # http.client's messages quote a header's value: a secret
            frames = "".join(traceback.format_tb(exc.__traceback__))
            log.error(
                "error answering %s %s: %s (its message withheld: it quotes a header)\n%s",
                request.method, request.url.path, type(exc).__name__, frames,
            )  # fmt: skip
        else:
            log.exception("error answering %s %s", request.method, request.url.path)
        return _error(500, "internal error")

    async def bad_body(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadBody)
        return _error(exc.status_code, str(exc))

    app.add_exception_handler(BadBody, bad_body)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, internal)


_HEADER_MODULES = (f"{os.sep}http{os.sep}client.py", f"{os.sep}urllib{os.sep}request.py")


def _quotes_headers(exc: BaseException) -> bool:
    """Whether an exception was raised by the HTTP client's header handling, whose
    messages hold the header's value (an API key): its message must not reach the log."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(_HEADER_MODULES)


def _document(app: FastAPI, guard: HttpGuard) -> None:
    """The OpenAPI document: FastAPI's paths, with every body and answer schema from the
    structs of kvindex.service.schema, and what the guard answers before any route: a 401
    wherever a token is asked for, a 403 where fleet changes are refused to the query token
    or to all, a 408 where a body is read (its deadline), a 400 on
    every path for a `Host` off the allow-list."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            doc.setdefault("components", {})["schemas"] = schema_components()
            _document_guard(doc, guard)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_guard(doc: dict[str, Any], guard: HttpGuard) -> None:
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if guard.asks_token(path, method.upper()):
                responses["401"] = _refusal("no or a wrong bearer token")
            if guard.refuses(path, method.upper()):
                responses["403"] = _refusal("fleet changes need the admin token, or are off")
            if "requestBody" in operation:
                responses["408"] = _refusal("the body did not arrive in the request timeout")
            if guard.allowed_hosts is not None:
                responses.setdefault("400", _refusal("a `Host` not on the allow-list"))


def _refusal(description: str) -> dict[str, Any]:
    return {"description": description, "content": json_content(ref(ErrorAnswer))}


def _no_store() -> StoreHealth:
    return StoreHealth("memory")


def _add_routes(
    app: FastAPI,
    fleet: Fleet,
    metrics: ServiceMetrics,
    store: Callable[[], StoreHealth],
    finders: Reconciler | None = None,
) -> None:
    _add_status_routes(app, fleet, metrics, store, finders)
    _add_instance_routes(app, fleet, finders)
    _add_lookup_routes(app, fleet, metrics)


def _add_status_routes(
    app: FastAPI,
    fleet: Fleet,
    metrics: ServiceMetrics,
    store: Callable[[], StoreHealth],
    finders: Reconciler | None = None,
) -> None:
    @app.get("/healthz", **operation_doc(HealthAnswer, errors=[503]))
    async def healthz() -> Response:
        """`ok` once the service accepts queries; `degraded` (still 200: lookups are
        answered from memory) with the reason while the state store can't persist; 503 if
        ingest stopped on an error; `starting` (503) until `min_engines` engines found by
        --discover are live, so a router's readiness probe waits."""
        failure = fleet.failure
        if failure is not None or not fleet.running:
            return _error(503, f"ingest is not running: {failure or 'stopped'}")
        waiting = finders.starting() if finders is not None else None
        if waiting is not None:
            return _json(HealthAnswer("starting", waiting), 503)
        health = store()
        if not health.up:
            return _json(HealthAnswer("degraded", f"store: {health.reason}"))
        return _json(HealthAnswer("ok"))

    @app.get("/livez", **operation_doc(HealthAnswer, errors=[503]))
    async def livez() -> Response:
        """`ok` while ingest runs: for a liveness (and startup) probe, which must not
        restart a replica that is only waiting at `/healthz`'s start gate (`starting`)."""
        failure = fleet.failure
        if failure is not None or not fleet.running:
            return _error(503, f"ingest is not running: {failure or 'stopped'}")
        return _json(HealthAnswer("ok"))

    @app.get("/v1/stats")
    async def stats() -> Response:
        """Fleet totals, windowed rates (per minute), ingest/lookup counters, the store."""
        return _json({**_stats(fleet, metrics), "store": store()})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _stats(fleet: Fleet, metrics: ServiceMetrics) -> dict[str, Any]:
    fleet_totals = fleet.summary()
    requests, hits = metrics.lookups.totals
    ingest = fleet.ingest
    return {
        "instances": fleet_totals.instances,
        "statuses": {s.value: n for s, n in fleet_totals.statuses.items()},
        "blocks": fleet_totals.blocks,
        "blocks_by_medium": fleet_totals.blocks_by_medium,
        "blocks_by_tier": fleet_totals.blocks_by_tier,
        "entries": fleet_totals.entries,
        "stored": fleet_totals.stored,
        "removed": fleet_totals.removed,
        "clears": fleet_totals.clears,
        "batches": fleet_totals.batches,
        "lost_batches": fleet_totals.counters["lost_batches"],
        "publisher_restarts": fleet_totals.counters["publisher_restarts"],
        "rates": fleet.rates_per_minute(),
        "ingest": {
            "items": ingest.items,
            "backlog": fleet_totals.backlog,
            "errors": ingest.errors,
            "longest_slice_seconds": ingest.longest_slice_seconds,
            "batches_in_c": ingest.batches_in_c,
            "gil_seconds": ingest.gil_seconds,
            "workers": fleet.workers,
            "index_shards": fleet.index_shards,
        },
        "lookups": {"requests": requests, "hits": hits, "hit_ratio": metrics.lookups.hit_ratio},
        "uptime_seconds": time.time() - metrics.started,
    }


def _add_instance_routes(app: FastAPI, fleet: Fleet, finders: Reconciler | None = None) -> None:
    @app.get("/v1/instances", **operation_doc(InstancesAnswer))
    async def instances() -> Response:
        """Every instance: status (worst of its ranks), counters, blocks, per-rank detail."""
        views = [instance_answer(v) for v in fleet.instance_views()]
        history = list(finders.history) if finders is not None else []
        return _json(InstancesAnswer(views, history))

    add_doc = operation_doc(
        InstanceAnswer,
        status=201,
        body=[AddInstanceBySpec, AddInstanceByFields],
        errors=[400, 409, 413, 422, 503],
    )

    @app.post("/v1/instances", status_code=201, **add_doc)
    async def add_instance(request: Request) -> Response:
        """Follow a new instance now, all its DP ranks or nothing (409 if the name exists
        or its sockets don't fit in the process: the error says the limit; 400 for a bad
        spec)."""
        try:
            spec = spec_of(await request.body())
            if fleet.has_instance(spec.name):
                raise DuplicateInstance(f"instance {spec.name!r} already exists")
            if spec.pending:  # an engine named by its URL: read it now, off the loop
                spec = await asyncio.to_thread(_first_read, spec)
            fleet.add_instance(spec)
        except DuplicateInstance as exc:
            return _error(409, str(exc))
        except CapacityError as exc:
            log.warning("POST /v1/instances refused: %s", exc)
            return _error(409, str(exc))
        except DiscoveryError as exc:
            return _error(422, str(exc))
        except (SpecError, zmq.ZMQError) as exc:
            return _error(400, str(exc))
        except WorkerUnavailable as exc:  # its ingest worker did not answer in time
            log.warning("POST /v1/instances: %s", exc)
            return _error(503, str(exc))
        try:
            view = fleet.instance_view(spec.name)
        except UnknownInstance:  # removed again meanwhile
            return _error(404, f"instance {spec.name!r} was removed meanwhile")
        return _json(instance_answer(view), 201)

    @app.delete(
        "/v1/instances/{name}",
        status_code=204,
        **operation_doc(None, status=204, errors=[404, 422, 503]),
    )
    async def remove_instance(name: str) -> Response:
        """Stop following an instance and forget what it holds (503: its ingest worker
        did not answer in time; the instance is then followed as before)."""
        try:
            fleet.remove_instance(name)
        except UnknownInstance:
            return _error(404, f"unknown instance {name!r}")
        except WorkerUnavailable as exc:
            log.warning("DELETE /v1/instances/%s: %s", name, exc)
            return _error(503, str(exc))
        return Response(status_code=204)

    @app.get("/v1/instances/{name}/blocks", **operation_doc(BlocksAnswer, errors=[404, 422]))
    async def blocks(name: str, medium: str | None = None) -> Response:
        """Every distinct block hash the instance holds now (all ranks), each once."""
        try:
            held = fleet.block_hashes(name, medium)
        except UnknownInstance:
            return _error(404, f"unknown instance {name!r}")
        hashes = sorted(render_hash(h) for h in held)
        return _json(BlocksAnswer(name, medium, len(hashes), hashes))


def _add_lookup_routes(app: FastAPI, fleet: Fleet, metrics: ServiceMetrics) -> None:
    lookup_errors = [400, 413, 422]

    # The dashboard's lookup box posts under /v1/dashboard/, where its session cookie goes.
    @app.post("/v1/dashboard/lookup", include_in_schema=False)
    @app.post(
        "/v1/lookup",
        **operation_doc(
            LookupAnswer,
            body=[LookupRequest, PromptLookupRequest, ChatLookupRequest],
            errors=[*lookup_errors, 404, 502, 503],
        ),
    )
    async def lookup(request: Request) -> Response:
        """Per instance, the longest cached prefix of the prompt, in whole blocks from its
        first token; rows best first, `best` = where a router should send it. The prompt
        as token ids, text or chat messages (tokenized by the model's tokenizer); with
        `model`, only its instances; with `score`, the routing score's answer."""
        body = decode_any_lookup(await request.body())
        if not isinstance(body, LookupRequest) or body.model is not None or body.score:
            return await lookup_answer(request.app.state.routing, metrics, body, _limit(request))
        _check_items(request, len(body.token_ids), "token_ids")
        keys = mm_keys(body)
        start = time.perf_counter()
        answer = fleet.lookup(body.token_ids, body.lora_name, body.cache_salt, **keys)
        return _answered(metrics, "tokens", start, answer)

    hash_doc = operation_doc(LookupAnswer, body=[HashLookupRequest], errors=lookup_errors)

    @app.post("/v1/lookup/hashes", **hash_doc)
    async def lookup_hashes(request: Request) -> Response:
        """Per instance, how many of these block hashes, from the first, it holds now."""
        body: HashLookupRequest = decode_body(await request.body(), HashLookupRequest)
        _check_items(request, len(body.block_hashes), "block_hashes")
        try:
            hashes = [parse_hash(text) for text in body.block_hashes]
        except ValueError as exc:
            return _error(400, str(exc))
        start = time.perf_counter()
        answer = fleet.lookup_hashes(hashes)
        return _answered(metrics, "hashes", start, answer)


def _answered(metrics: ServiceMetrics, kind: str, start: float, answer: LookupAnswer) -> Response:
    metrics.lookups.observe(kind, time.perf_counter() - start, answer.hit)
    return _json(answer)
