"""The peers' API, as NVIDIA Dynamo's standalone indexer answers it (docs/peers.md):
`POST /register`, `/unregister`, `/query`, `/query_by_hash`, `GET /workers`, `/health`,
with JSON or msgpack bodies (`Content-Type: application/msgpack`; the answer follows the
request's format).

A worker registered by `/register` is a kvindex instance named `ID:RANK` (one per DP rank,
as Dynamo registers them) with `model=` its `model_name`, `routing_group=` and `block_size=`
its own (in the spec: the store keeps them with the instance, so they survive a restart);
`/query` answers every instance of the model and routing group, keyed by worker id (an
instance not named `ID:RANK`, followed by `--instance`, answers under its name, with its
DP ranks).
"""

from __future__ import annotations

import re
import time
from enum import Enum
from typing import Any

import msgspec
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvindex.index.localhash import LocalHashesOff
from kvindex.runtime import (
    DuplicateInstance,
    Fleet,
    InstanceMatch,
    LookupAnswer,
    UnknownInstance,
    WorkerUnavailable,
)
from kvindex.service.lookups import Routing
from kvindex.service.metrics import ServiceMetrics
from kvindex.service.schema import (
    BadBody,
    PeerInstance,
    PeerStatus,
    QueryAnswer,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
    UnregisterRequest,
    encode,
    mm_keys,
    operation_doc,
)
from kvindex.subscriber import CapacityError, InstanceSpec, SpecError, Status

__all__ = ["install_peers", "peer_query_answer", "worker_of"]

_WORKER_NAME = re.compile(r"([0-9]{1,20}):([0-9]{1,4})")
_MSGPACK = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_PEER_TAGS: list[str | Enum] = ["peers (Dynamo's standalone indexer)"]


def _is_msgpack(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in _MSGPACK


class _PeerFailure(Exception):
    """A peer request refused: answered as `{"error"}` in the request's own format."""

    def __init__(self, status: int, message: str, msgpack: bool) -> None:
        super().__init__(message)
        self.status = status
        self.msgpack = msgpack


async def _peer_body(request: Request, kind: type[Any]) -> tuple[Any, bool]:
    """A peer body, JSON or msgpack, and whether it was msgpack (the answer follows it).
    Lax (`strict=False`): JSON Schema counts `1.0` as an integer, and so do these bodies."""
    msgpack = _is_msgpack(request)
    raw = await request.body()
    if not raw.strip():
        raise _PeerFailure(400, "a body is required", msgpack)
    try:
        if msgpack:
            return msgspec.msgpack.decode(raw, type=kind, strict=False), msgpack
        return msgspec.json.decode(raw, type=kind, strict=False), msgpack
    except msgspec.ValidationError as exc:
        raise _PeerFailure(422, f"invalid body: {exc}", msgpack) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        what = "msgpack" if msgpack else "JSON"
        raise _PeerFailure(400, f"body is not valid {what}: {exc}", msgpack) from None


async def _peer_failed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _PeerFailure)
    return _peer_error(exc.status, str(exc), exc.msgpack)


def _peer_answer(content: Any, status: int, msgpack: bool) -> Response:
    if msgpack:
        return Response(msgspec.msgpack.encode(content), status, media_type="application/msgpack")
    return Response(encode(content), status, media_type="application/json")


def _peer_error(status: int, message: str, msgpack: bool) -> Response:
    return _peer_answer({"error": message}, status, msgpack)


def worker_of(name: str) -> tuple[str, int | None]:
    """A kvindex instance as the peers' API names it: (worker id, its DP rank) for `ID:RANK`,
    else (the name, None: its ranks are its own)."""
    m = _WORKER_NAME.fullmatch(name)
    return (m[1], int(m[2])) if m else (name, None)


def peer_query_answer(routing: Routing, rows: list[InstanceMatch], group: str) -> QueryAnswer:
    """Dynamo's `/query` answer from a lookup's rows (matched tokens, per worker and rank)."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, PeerInstance] = {}
    specs = routing.fleet.specs
    for row in rows:
        spec = specs.get(row.name)
        if spec is None or _group(spec) != group or not row.matched_blocks:
            continue
        size = row.block_size or spec.block_size or 0
        worker, rank = worker_of(row.name)
        tiers = row.by_tier or {"gpu": row.matched_blocks}
        gpu = tiers.get("gpu", 0)
        cpu = gpu + tiers.get("cpu", 0)
        disk = cpu + tiers.get("disk", 0)
        by_rank = (
            {str(rank): gpu * size}
            if rank is not None
            else {
                str(r.rank): (gpu if r.rank == row.best_rank else r.matched_blocks) * size
                for r in row.ranks
            }
        )
        if gpu:
            scores.setdefault(worker, {}).update({r: t for r, t in by_rank.items() if t})
        seen = instances.get(worker)
        dp = {**(seen.dp if seen else {}), **by_rank}
        instances[worker] = PeerInstance(
            max(disk * size, seen.longest_matched if seen else 0),
            max(gpu * size, seen.gpu if seen else 0),
            dp,
            max(cpu * size, seen.cpu if seen else 0),
            max(disk * size, seen.disk if seen else 0),
        )
    return QueryAnswer(scores, [], instances)


def _group(spec: InstanceSpec) -> str:
    """The instance's routing group in the peers' API (Dynamo's default is `default`)."""
    return spec.routing_group or "default"


def _served(routing: Routing, model: str, group: str) -> bool:
    specs = routing.fleet.specs  # changed by ingest threads meanwhile: one get per name
    found = (specs.get(name) for name in routing.fleet.models().get(model, []))
    return any(spec is not None and _group(spec) == group for spec in found)


def _no_indexer(model: str, group: str) -> str:
    return f"no indexer for model={model} routing_group={group}"


def _spec_of_register(body: RegisterRequest) -> InstanceSpec:
    """The instance a `/register` names: `ID:RANK`, with the worker's model, block size and
    routing group in its spec."""
    return InstanceSpec(
        f"{body.instance_id}:{body.dp_rank}",
        body.endpoint,
        body.replay_endpoint or None,
        model=body.model_name,
        rank=body.dp_rank,
        block_size=body.block_size,
        routing_group=None if body.routing_group == "default" else body.routing_group,
    ).client_checked()


def _register(fleet: Fleet, body: RegisterRequest, packed: bool) -> Response:
    try:
        fleet.add_instance(_spec_of_register(body))
    except DuplicateInstance:
        message = f"instance {body.instance_id} dp_rank {body.dp_rank} already registered"
        return _peer_error(409, message, packed)
    except (SpecError, ValueError, zmq.ZMQError) as exc:
        return _peer_error(400, str(exc), packed)
    except CapacityError as exc:
        return _peer_error(409, str(exc), packed)
    except WorkerUnavailable as exc:
        return _peer_error(503, str(exc), packed)
    return _peer_answer(PeerStatus("ok"), 201, packed)


def _unregistered(fleet: Fleet, body: UnregisterRequest) -> list[str]:
    """Stop following the worker's instances that `body` names; the names removed."""
    gone = []
    for name in fleet.models().get(body.model_name, []):
        worker, rank = worker_of(name)
        spec = fleet.specs.get(name)
        if worker != str(body.instance_id) or spec is None:
            continue
        if body.routing_group is not None and _group(spec) != body.routing_group:
            continue
        if body.dp_rank is not None and body.routing_group is not None and rank != body.dp_rank:
            continue
        try:
            fleet.remove_instance(name)
        except UnknownInstance:
            continue
        gone.append(name)
    return gone


def _workers(fleet: Fleet, model_name: str | None, routing_group: str | None) -> list[Any]:
    """`GET /workers`: per worker, its model, group, block size and listeners per rank."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name, spec in sorted(fleet.specs.items()):
        group = _group(spec)
        if spec.model is None or (model_name is not None and spec.model != model_name):
            continue
        if routing_group is not None and group != routing_group:
            continue
        worker, rank = worker_of(name)
        entry = out.setdefault(
            (worker, spec.model, group),
            {
                "instance_id": int(worker) if worker.isdigit() else worker,
                # an engine without KV events (events=none): its blocks are what kvindex
                # routed there, in /v1/route and scored lookups only
                "source": "approximate" if spec.events_none else "zmq",
                "status": "active",
                "model_name": spec.model,
                "routing_group": group,
                "block_size": spec.block_size,
                "endpoints": {},
                "listeners": {},
            },
        )
        try:
            instance_status = fleet.status(name)
        except UnknownInstance:  # removed while this was listed
            continue
        for source in spec.sources():
            status = _listener_status(instance_status)
            key = str(source.source.rank if rank is None else rank)
            entry["endpoints"][key] = source.endpoint
            entry["listeners"][key] = {"endpoint": source.endpoint, "status": status}
            if status != "active":
                entry["status"] = status
    return list(out.values())


def _add_membership_routes(app: FastAPI, fleet: Fleet) -> None:
    @app.post(
        "/register",
        status_code=201,
        tags=_PEER_TAGS,
        **operation_doc(
            PeerStatus, status=201, body=[RegisterRequest], errors=[400, 409, 413, 422, 503]
        ),
    )
    async def register(request: Request) -> Response:
        """Follow a worker's DP rank (Dynamo's shape): `{"status": "ok"}`, 201."""
        body: RegisterRequest
        body, packed = await _peer_body(request, RegisterRequest)
        return _register(fleet, body, packed)

    @app.post(
        "/unregister",
        tags=_PEER_TAGS,
        **operation_doc(PeerStatus, body=[UnregisterRequest], errors=[400, 404, 413, 422, 503]),
    )
    async def unregister(request: Request) -> Response:
        """Stop following a worker (every rank and group of the model, or the one named)."""
        body: UnregisterRequest
        body, packed = await _peer_body(request, UnregisterRequest)
        try:
            gone = _unregistered(fleet, body)
        except WorkerUnavailable as exc:
            return _peer_error(503, str(exc), packed)
        if not gone:
            return _peer_error(404, f"instance {body.instance_id} not found", packed)
        return _peer_answer(PeerStatus("ok"), 200, packed)

    @app.get("/workers", tags=_PEER_TAGS, **operation_doc(None))
    async def workers(model_name: str | None = None, routing_group: str | None = None) -> Response:
        """Every worker: model, routing group, block size, endpoints and listeners per rank."""
        return _peer_answer(_workers(fleet, model_name, routing_group), 200, False)

    @app.get("/health", tags=_PEER_TAGS, response_class=Response, **operation_doc(None))
    async def health() -> Response:
        """200 with an empty body, as Dynamo answers."""
        return Response(status_code=200)


_SALTED_BY_HASH = (
    "cache_salt is not accepted by /query_by_hash; block_hashes must already "
    "include the intended cache salt"
)
_NO_LOCAL_HASHES = (
    "this kvindex keeps no local block hashes: start it with --local-hashes "
    "(or send the token ids to /query)"
)


def _over_limit(request: Request, count: int, what: str) -> str | None:
    """Why a lookup of `count` items is refused (serve's --max-lookup-tokens), or None."""
    limit: int = request.app.state.max_lookup_items
    return f"{what} has {count} items, over the limit of {limit}" if count > limit else None


def _scores(routing: Routing, answer: LookupAnswer, group: str, packed: bool) -> Response:
    return _peer_answer(peer_query_answer(routing, answer.instances, group), 200, packed)


def _add_query_routes(app: FastAPI, routing: Routing, metrics: ServiceMetrics) -> None:
    fleet = routing.fleet

    @app.post(
        "/query",
        tags=_PEER_TAGS,
        **operation_doc(QueryAnswer, body=[QueryRequest], errors=[400, 404, 413, 422]),
    )
    async def query(request: Request) -> Response:
        """Per worker and DP rank, the matched tokens of the prompt (Dynamo's shape)."""
        body: QueryRequest
        body, packed = await _peer_body(request, QueryRequest)
        too_many = _over_limit(request, len(body.token_ids), "token_ids")
        if too_many is not None:
            return _peer_error(422, too_many, packed)
        if not _served(routing, body.model_name, body.routing_group):
            return _peer_error(404, _no_indexer(body.model_name, body.routing_group), packed)
        try:
            keys = mm_keys(body)
        except BadBody as exc:
            return _peer_error(exc.status_code, str(exc), packed)
        start = time.perf_counter()
        answer = fleet.lookup(
            body.token_ids, body.lora_name, body.cache_salt, model=body.model_name, **keys
        )
        metrics.lookups.observe("peer", time.perf_counter() - start, answer.hit)
        return _scores(routing, answer, body.routing_group, packed)

    @app.post(
        "/query_by_hash",
        tags=_PEER_TAGS,
        **operation_doc(QueryAnswer, body=[QueryByHashRequest], errors=[400, 404, 413, 422, 501]),
    )
    async def query_by_hash(request: Request) -> Response:
        """Per worker and DP rank, the matched tokens of the prompt these Dynamo local
        block hashes stand for (XXH3 of each block's tokens, seeded by the LoRA name and
        cache salt: kvindex.index.localhash); Dynamo's shape, as `/query`. 501 where the
        index keeps no local hashes (the compiled core without `--local-hashes`)."""
        body: QueryByHashRequest
        body, packed = await _peer_body(request, QueryByHashRequest)
        if body.cache_salt is not None:  # before the model, as Dynamo refuses it
            return _peer_error(400, _SALTED_BY_HASH, packed)
        too_many = _over_limit(request, len(body.block_hashes), "block_hashes")
        if too_many is not None:
            return _peer_error(422, too_many, packed)
        if not _served(routing, body.model_name, body.routing_group):
            return _peer_error(404, _no_indexer(body.model_name, body.routing_group), packed)
        start = time.perf_counter()
        try:
            answer = fleet.lookup_local_hashes(
                body.block_hashes, body.lora_name, model=body.model_name
            )
        except LocalHashesOff:
            return _peer_error(501, _NO_LOCAL_HASHES, packed)
        metrics.lookups.observe("peer", time.perf_counter() - start, answer.hit)
        return _scores(routing, answer, body.routing_group, packed)


def _listener_status(status: Status) -> str:
    if status == Status.LIVE:
        return "active"
    if status == Status.DOWN:
        return "failed"
    return "pending"


def install_peers(app: FastAPI, routing: Routing, metrics: ServiceMetrics) -> None:
    """The peers' API on `app`."""
    app.add_exception_handler(_PeerFailure, _peer_failed)
    _add_membership_routes(app, routing.fleet)
    _add_query_routes(app, routing, metrics)
