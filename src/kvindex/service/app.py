"""The HTTP API of `kvindex serve` (see shared/interface.md), as a FastAPI app.

Every handler is `async def`: FastAPI runs plain `def` handlers on a thread pool, which
would read the index while the ingest task changes it. Async handlers run on the loop's
own thread, between two ingest slices, so they always see a consistent index.

Answers are encoded with msgspec straight into a `Response` (the pydantic models below
document them in OpenAPI without validating every answer again): a block list can hold
millions of hashes, and a lookup should cost microseconds, not a model validation.
Errors are always `{"error": "..."}`; bad input never gets a 500.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import msgspec
import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException

from kvindex.runtime import (
    DuplicateInstance,
    Fleet,
    InstanceView,
    LookupAnswer,
    RankView,
    UnknownInstance,
)
from kvindex.security.http import HttpGuard
from kvindex.service.dashboard import install_dashboard
from kvindex.service.docs import install_docs
from kvindex.service.metrics import ServiceMetrics
from kvindex.subscriber import InstanceSpec, SpecError, Status
from kvindex.wire import parse_hash, render_hash

__all__ = ["MAX_BODY_BYTES", "MAX_LOOKUP_ITEMS", "create_app"]

log = logging.getLogger(__name__)

MAX_LOOKUP_ITEMS = 1_000_000  # token ids or block hashes in one lookup
MAX_BODY_BYTES = 32 * 1024 * 1024  # a lookup of a million ids is ~8 MB of JSON

_encoder = msgspec.json.Encoder()
_T = TypeVar("_T")

# Token ids are vocabulary indices; the bound is JSON's largest exact integer, so that the
# documented maximum means the same to every JSON parser (a client's, a schema checker's).
MAX_TOKEN_ID = 2**53 - 1
# A hash as `render_hash` writes it: decimal (an int) or lowercase hex (bytes).
HASH_PATTERN = r"^([0-9]{1,20}|-[0-9]{1,18}|([0-9a-f]{2}){1,128})$"
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]


# -- request and answer models (OpenAPI) -----------------------------------------------


class LookupRequest(BaseModel):
    """Documents `/v1/lookup`'s body; `_LookupBody` below is what actually decodes it."""

    model_config = ConfigDict(extra="forbid")
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOOKUP_ITEMS)]
    lora_name: Annotated[str | None, Field(max_length=1024)] = None
    cache_salt: Annotated[str | None, Field(max_length=1024)] = None


class HashLookupRequest(BaseModel):
    """Documents `/v1/lookup/hashes`'s body; `_HashLookupBody` decodes it."""

    model_config = ConfigDict(extra="forbid")
    block_hashes: Annotated[
        list[Annotated[str, Field(max_length=256, pattern=HASH_PATTERN)]],
        Field(max_length=MAX_LOOKUP_ITEMS),
    ]


# Lookup bodies are decoded by msgspec: a 2,048-token prompt takes ~50 us instead of ~300 us
# through json + pydantic, and its errors name the exact element (`$.token_ids[3]`).
_Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class _LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: Annotated[list[_Token], msgspec.Meta(max_length=MAX_LOOKUP_ITEMS)]
    lora_name: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=1024)] | None = None


class _HashLookupBody(msgspec.Struct, forbid_unknown_fields=True):
    block_hashes: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]],
        msgspec.Meta(max_length=MAX_LOOKUP_ITEMS),
    ]


_lookup_decoder = msgspec.json.Decoder(_LookupBody)
_hash_lookup_decoder = msgspec.json.Decoder(_HashLookupBody)


class _LenientLookupBody(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: Annotated[list[int | float], msgspec.Meta(max_length=MAX_LOOKUP_ITEMS)]
    lora_name: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=1024)] | None = None


_lenient_lookup_decoder = msgspec.json.Decoder(_LenientLookupBody)


def _integral_lookup(raw: bytes) -> _LookupBody | None:
    """JSON Schema counts `1.0` as an integer: accept token ids written so (off the fast
    path: only after the strict decoder refused the body)."""
    try:
        body = _lenient_lookup_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    tokens = []
    for value in body.token_ids:
        if isinstance(value, float) and not value.is_integer():
            return None
        if not 0 <= value <= MAX_TOKEN_ID:
            return None
        tokens.append(int(value))
    return _LookupBody(tokens, body.lora_name, body.cache_salt)


async def _decode_lookup(request: Request) -> _LookupBody:
    try:
        return await _decode(request, _lookup_decoder)
    except BadBody as exc:
        body = _integral_lookup(await request.body()) if exc.status_code == 422 else None
        if body is None:
            raise
        return body


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class BadBody(Exception):
    """A request body that is not the JSON asked for: answered 400 (not JSON) or 422."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


async def _decode(request: Request, decoder: msgspec.json.Decoder[_T]) -> _T:
    raw = await request.body()
    if not raw.strip():
        raise BadBody(400, "a JSON body is required")
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadBody(422, f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadBody(400, f"body is not valid JSON: {exc}") from None


class AddInstanceRequest(BaseModel):
    """Either `spec` (`NAME=EP[,replay=EP][,topic=T][,dp=N]`) or `name` + `endpoint`."""

    model_config = ConfigDict(extra="forbid")
    spec: Annotated[str | None, Field(max_length=4096)] = None
    name: Annotated[str | None, Field(max_length=256)] = None
    endpoint: Annotated[str | None, Field(max_length=1024)] = None
    replay_endpoint: Annotated[str | None, Field(max_length=1024)] = None
    topic: Annotated[str | None, Field(max_length=1024)] = None
    dp: StrictInt | None = None


class ErrorOut(BaseModel):
    error: str


class HealthOut(BaseModel):
    status: str


class RankOut(BaseModel):
    rank: int
    status: Status
    last_seq: int | None
    gaps: int
    received: int
    delivered: int
    replayed_batches: int
    lost_batches: int
    decode_errors: int
    publisher_restarts: int
    ingest_lag_seconds: float | None
    problem: str | None


class InstanceOut(BaseModel):
    name: str
    status: Status
    last_seq: int | None
    blocks: int
    gaps: int
    replayed_batches: int
    lost_batches: int
    decode_errors: int
    publisher_restarts: int
    dp: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    spec: str
    blocks_by_medium: dict[str, int]
    blocks_by_tier: dict[str, int] = Field(
        description="The same blocks per tier: gpu, cpu, disk, external (every engine's "
        "medium names map to these)."
    )
    stored: int
    removed: int
    clears: int
    batches: int
    ingest_lag_seconds: float | None
    last_batch_age_seconds: float | None
    problem: str | None = Field(
        description="Why the publisher can't be followed (a host that doesn't resolve, "
        "nothing listening, a refused CURVE handshake), once diagnosed; null otherwise."
    )
    ranks: list[RankOut]


class InstancesOut(BaseModel):
    instances: list[InstanceOut]


class BlocksOut(BaseModel):
    name: str
    medium: str | None
    count: int
    block_hashes: list[str]


class RankMatchOut(BaseModel):
    rank: int
    matched_blocks: int


class LookupRowOut(BaseModel):
    name: str
    status: Status
    matched_blocks: int
    matched_tokens: int | None
    block_size: int | None
    best_rank: int
    ranks: list[RankMatchOut]
    by_tier: dict[str, int] = {}
    by_group: dict[int, int] = {}


class LookupOut(BaseModel):
    best: str | None
    instances: list[LookupRowOut]


# -- answers ---------------------------------------------------------------------------


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(_encoder.encode(content), status_code, media_type="application/json")


def _error(status_code: int, message: str) -> Response:
    return _json({"error": message}, status_code)


def _rank_dict(rank: RankView) -> dict[str, Any]:
    return {
        "rank": rank.rank,
        "status": rank.status.value,
        "last_seq": rank.last_seq,
        "gaps": rank.gaps,
        "received": rank.received,
        "delivered": rank.delivered,
        "replayed_batches": rank.replayed_batches,
        "lost_batches": rank.lost_batches,
        "decode_errors": rank.decode_errors,
        "publisher_restarts": rank.publisher_restarts,
        "ingest_lag_seconds": rank.ingest_lag_seconds,
        "problem": rank.problem,
    }


def _instance_dict(view: InstanceView) -> dict[str, Any]:
    spec = view.spec
    return {
        "name": view.name,
        "status": view.status.value,
        "last_seq": view.last_seq,
        "blocks": view.blocks,
        **view.totals(),
        "dp": spec.dp,
        "endpoint": spec.endpoint,
        "replay_endpoint": spec.replay_endpoint,
        "topic": spec.topic,
        "spec": spec.render(),
        "blocks_by_medium": view.blocks_by_medium,
        "blocks_by_tier": view.blocks_by_tier,
        "stored": view.stored,
        "removed": view.removed,
        "clears": view.clears,
        "batches": view.batches,
        "ingest_lag_seconds": view.ingest_lag_seconds,
        "last_batch_age_seconds": view.last_batch_age_seconds,
        "problem": view.problem,
        "ranks": [_rank_dict(rank) for rank in view.ranks],
    }


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _spec_from(body: AddInstanceRequest) -> InstanceSpec:
    fields = (body.name, body.endpoint, body.replay_endpoint, body.topic, body.dp)
    if body.spec is not None:
        if any(f is not None for f in fields):
            raise SpecError("give either 'spec' or the fields (name, endpoint, ...), not both")
        return InstanceSpec.parse(body.spec)
    if not body.name or not body.endpoint:
        raise SpecError("'name' and 'endpoint' are required (or a 'spec')")
    return InstanceSpec(
        name=body.name,
        endpoint=body.endpoint,
        replay_endpoint=body.replay_endpoint or None,
        topic=body.topic or "",
        dp=1 if body.dp is None else body.dp,
    )


# -- the app ---------------------------------------------------------------------------


class LookupPriority:
    """Counts lookups in flight in `Fleet.urgent`, so ingest slices shrink while a router
    waits for an answer."""

    def __init__(self, app: Callable[..., Awaitable[None]], fleet: Fleet) -> None:
        self.app = app
        self.fleet = fleet

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/lookup"):
            await self.app(scope, receive, send)
            return
        self.fleet.urgent += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.fleet.urgent -= 1


class BodyLimit:
    """Refuses request bodies over `limit` bytes (413) before anything parses them."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        response = _error(413, f"request body over {self.limit} bytes")
        await response(scope, receive, send)


def create_app(
    fleet: Fleet,
    *,
    manage_fleet: bool = True,
    max_body_bytes: int = MAX_BODY_BYTES,
    guard: HttpGuard | None = None,
) -> FastAPI:
    """The API over `fleet`. With `manage_fleet`, the app's lifespan starts its ingest in
    the server's loop and stops it (closing the sockets) at shutdown. `guard` sets bearer
    tokens, the lookup size limit and the request body deadline."""
    guard = guard or HttpGuard()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_fleet:
            await fleet.start()
        try:
            yield
        finally:
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
    metrics = ServiceMetrics(fleet)
    app.state.fleet = fleet
    app.state.metrics = metrics
    app.state.max_lookup_items = guard.max_lookup_items
    _add_error_handlers(app)
    _add_routes(app, fleet, metrics)
    install_dashboard(app, fleet)  # GET /, its assets and /v1/dashboard/*
    install_docs(app)  # GET /docs and its assets
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    guard.install(app)  # refuse bad tokens before reading any body
    app.add_middleware(LookupPriority, fleet=fleet)  # outermost: counts from the start
    return app


def _check_items(request: Request, count: int, what: str) -> None:
    limit: int = request.app.state.max_lookup_items
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
        log.exception("error answering %s %s", request.method, request.url.path)
        return _error(500, "internal error")

    async def bad_body(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadBody)
        return _error(exc.status_code, str(exc))

    app.add_exception_handler(BadBody, bad_body)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, internal)


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (400, 404, 409, 413, 422)
}


def _add_routes(app: FastAPI, fleet: Fleet, metrics: ServiceMetrics) -> None:
    _add_status_routes(app, fleet, metrics)
    _add_instance_routes(app, fleet)
    _add_lookup_routes(app, fleet, metrics)


def _add_status_routes(app: FastAPI, fleet: Fleet, metrics: ServiceMetrics) -> None:
    @app.get("/healthz", response_model=HealthOut, responses={503: {"model": ErrorOut}})
    async def healthz() -> Response:
        """`ok` once the service accepts queries (503 if ingest stopped on an error)."""
        failure = fleet.failure
        if failure is not None or not fleet.running:
            return _error(503, f"ingest is not running: {failure or 'stopped'}")
        return _json({"status": "ok"})

    @app.get("/v1/stats")
    async def stats() -> Response:
        """Fleet totals, windowed rates (per minute) and ingest/lookup counters."""
        return _json(_stats(fleet, metrics))

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
        },
        "lookups": {"requests": requests, "hits": hits, "hit_ratio": metrics.lookups.hit_ratio},
        "uptime_seconds": time.time() - metrics.started,
    }


def _add_instance_routes(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/v1/instances", response_model=InstancesOut)
    async def instances() -> Response:
        """Every instance: status (worst of its ranks), counters, blocks, per-rank detail."""
        return _json({"instances": [_instance_dict(v) for v in fleet.instance_views()]})

    @app.post("/v1/instances", status_code=201, response_model=InstanceOut, responses=_ERRORS)
    async def add_instance(body: AddInstanceRequest) -> Response:
        """Follow a new instance now (409 if the name exists, 400 for a bad spec)."""
        try:
            spec = _spec_from(body)
            fleet.add_instance(spec)
        except DuplicateInstance as exc:
            return _error(409, str(exc))
        except (SpecError, zmq.ZMQError) as exc:
            return _error(400, str(exc))
        return _json(_instance_dict(fleet.instance_view(spec.name)), 201)

    @app.delete("/v1/instances/{name}", status_code=204, responses=_ERRORS)
    async def remove_instance(name: str) -> Response:
        """Stop following an instance and forget what it holds."""
        try:
            fleet.remove_instance(name)
        except UnknownInstance:
            return _error(404, f"unknown instance {name!r}")
        return Response(status_code=204)

    @app.get("/v1/instances/{name}/blocks", response_model=BlocksOut, responses=_ERRORS)
    async def blocks(name: str, medium: str | None = None) -> Response:
        """Every distinct block hash the instance holds now (all ranks), each once."""
        try:
            held = fleet.block_hashes(name, medium)
        except UnknownInstance:
            return _error(404, f"unknown instance {name!r}")
        hashes = sorted(render_hash(h) for h in held)
        return _json({"name": name, "medium": medium, "count": len(hashes), "block_hashes": hashes})


def _add_lookup_routes(app: FastAPI, fleet: Fleet, metrics: ServiceMetrics) -> None:
    @app.post(
        "/v1/lookup",
        response_model=LookupOut,
        responses=_ERRORS,
        openapi_extra=_body_doc(LookupRequest),
    )
    async def lookup(request: Request) -> Response:
        """Per instance, the longest cached prefix of the prompt, in whole blocks from its
        first token; rows best first, `best` = where a router should send it."""
        body = await _decode_lookup(request)
        _check_items(request, len(body.token_ids), "token_ids")
        start = time.perf_counter()
        answer = fleet.lookup(body.token_ids, body.lora_name, body.cache_salt)
        return _answered(metrics, "tokens", start, answer)

    @app.post(
        "/v1/lookup/hashes",
        response_model=LookupOut,
        responses=_ERRORS,
        openapi_extra=_body_doc(HashLookupRequest),
    )
    async def lookup_hashes(request: Request) -> Response:
        """Per instance, how many of these block hashes, from the first, it holds now."""
        body = await _decode(request, _hash_lookup_decoder)
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
