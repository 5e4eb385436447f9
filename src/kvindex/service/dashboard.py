"""The live dashboard at `GET /`: a static page fed by server-sent events.

`install_dashboard(app, fleet)` adds:

- `GET /`: the page (`static/index.html`; its script and styles, and the vendored uPlot
  charting library, under `GET /dashboard/{file}`: no build step, no network);
- `GET /v1/dashboard/stream`: server-sent events. The first, `init`, carries the history
  (the last 15 minutes, one point a second), each instance's usage trend and the latest
  prefix-sharing analysis; then one snapshot a second (fleet header, per-instance rows,
  the new history point, and the sharing analysis when it was recomputed);
- `GET /v1/dashboard/snapshot`: the same `init` message as plain JSON;
- `GET /v1/dashboard/prompts`: recent prompts to offer in the lookup box, when the app was
  given a source of them (`app.state.recent_prompts`, a callable; `kvindex demo` sets it).

Sampling runs in the app's own loop (like every read of the index), once a second; it
backs off if a sample ever costs more than a few percent of the loop. The prefix-sharing
walk runs only while a page is open, every few seconds, over a bounded number of nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from kvindex.index.sharing import Sharing
from kvindex.runtime import Fleet, FleetSummary, InstanceView
from kvindex.runtime.engine_metrics import EngineFigures, MetricsScraper

__all__ = ["Dashboard", "install_dashboard", "render_dashboard"]

HISTORY_SECONDS = 15 * 60
DEFAULT_MAX_STREAMS = 32  # dashboard event streams open at once (serve --max-streams)
TREND_POINTS = 120  # per-instance usage sparkline: the last two minutes
SHARING_EVERY = 5.0
SHARING_MAX_NODES = 30_000
SHARING_MAX_INSTANCES = 16
_MAX_SAMPLE_SHARE = 0.05  # of the loop's time, before sampling slows down

_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
_encoder = msgspec.json.Encoder()


def _static(name: str) -> bytes:
    folder = resources.files("kvindex.service") / "static"
    path = folder / ("vendor/" + name if name.startswith("uPlot") else name)
    return path.read_bytes()


def render_dashboard(fleet: Fleet | None = None) -> str:
    """The dashboard page (static: everything live comes over the stream)."""
    return _static("index.html").decode()


@dataclass(slots=True)
class _Track:
    """One instance between two samples: its counters then, its rates, its usage trend."""

    stored: int
    removed: int
    stores_per_s: float = 0.0
    removes_per_s: float = 0.0
    trend: deque[int] = field(default_factory=lambda: deque(maxlen=TREND_POINTS))


class Dashboard:
    """History and snapshots of a fleet for the dashboard page."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        interval: float = 1.0,
        engines: MetricsScraper | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        self.fleet = fleet
        self.max_streams = max_streams  # event streams open at once; more: 503
        self.streams = 0
        self.engines = engines  # the engines' own /metrics (kvindex.runtime.engine_metrics)
        self.interval = interval
        self.history: deque[dict[str, Any]] = deque(maxlen=int(HISTORY_SECONDS / interval))
        self.tracks: dict[str, _Track] = {}
        self.latest: dict[str, Any] | None = None
        self.latest_bytes = b""
        self.sharing: dict[str, Any] | None = None
        self.clients = 0
        self.closed = False
        self._last_sample: float | None = None
        self._next_sharing = 0.0
        self._sharing_cost = 0.0
        self._task: asyncio.Task[None] | None = None
        self._tick: asyncio.Event | None = None

    # -- sampling ------------------------------------------------------------------------

    def sample(self, now: float | None = None) -> dict[str, Any]:
        """Read the fleet once: rates since the last sample, one history point."""
        now = time.time() if now is None else now
        elapsed = None if self._last_sample is None else max(1e-3, now - self._last_sample)
        self._last_sample = now
        views = self.fleet.instance_views()
        scraped = self.engines.figures() if self.engines is not None else {}
        rows = [
            {**self._row(view, elapsed), "engine": _engine(scraped.get(view.name))}
            for view in views
        ]
        for gone in set(self.tracks) - {v.name for v in views}:
            del self.tracks[gone]
        header = _header(self.fleet.summary(views), rows)
        point = {
            "t": now,
            "stores": header["stores_per_s"],
            "removes": header["removes_per_s"],
            "blocks": header["blocks_by_tier"],
        }
        self.history.append(point)
        self.latest = {"t": now, "fleet": header, "instances": rows, "point": point}
        return self.latest

    def _row(self, view: InstanceView, elapsed: float | None) -> dict[str, Any]:
        track = self.tracks.get(view.name)
        if track is None:
            track = self.tracks[view.name] = _Track(view.stored, view.removed)
        elif elapsed is not None:
            track.stores_per_s = max(0, view.stored - track.stored) / elapsed
            track.removes_per_s = max(0, view.removed - track.removed) / elapsed
            track.stored, track.removed = view.stored, view.removed
        track.trend.append(view.blocks)
        return {
            "name": view.name,
            "status": view.status.value,
            "dp": view.spec.dp,
            "blocks": view.blocks,
            "blocks_by_medium": view.blocks_by_medium,
            "blocks_by_tier": view.blocks_by_tier,
            "stores_per_s": round(track.stores_per_s, 2),
            "removes_per_s": round(track.removes_per_s, 2),
            **view.totals(),
            "clears": view.clears,
            "last_seq": view.last_seq,
            "ingest_lag_s": view.ingest_lag_seconds,
            "load": _load(view),
            # an engine without KV events: its blocks are what kvindex routed there
            "approximate": view.approximate,
            "approximate_blocks": cache.blocks if (cache := view.approximate_cache) else None,
        }

    def analyse_sharing(self) -> dict[str, Any]:
        started = time.perf_counter()
        result = self.fleet.sharing(SHARING_MAX_INSTANCES, SHARING_MAX_NODES)
        self.sharing = _sharing_dict(result)
        self._sharing_cost = time.perf_counter() - started
        # When and how often: the page says so, since the instance table is newer (1 s).
        self.sharing["t"] = time.time()
        self.sharing["every"] = max(SHARING_EVERY, self._sharing_cost / _MAX_SAMPLE_SHARE)
        return self.sharing

    def init_message(self, since: float | None = None) -> dict[str, Any]:
        """Everything a page needs to draw itself; with `since` (a reconnecting page's
        last snapshot time), only the history after it."""
        if self.latest is None:
            self.sample()
        if self.sharing is None:
            self.analyse_sharing()
        history = list(self.history)
        if since is not None:
            history = [point for point in history if point["t"] > since]
        return {
            "interval": self.interval,
            "history_seconds": HISTORY_SECONDS,
            "resumed": since is not None,
            "snapshot": self.latest,
            "history": history,
            "trends": {name: list(track.trend) for name, track in self.tracks.items()},
            "sharing": self.sharing,
        }

    # -- the sampling task ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the sampler runs in the current loop."""
        task = self._task
        return task is not None and not task.done() and task.get_loop() is _loop()

    def ensure_running(self) -> None:
        """Start the sampler in the running loop (an app can be served by several loops
        in turn, as tests do: each gets its own)."""
        if self.running:
            return
        self._abandon()
        self.closed = False
        self._tick = None  # an Event belongs to the loop that first waited on it
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvindex-dashboard")

    async def stop(self) -> None:
        self.close()
        task = self._task
        if task is not None and task.get_loop() is _loop():
            self._task = None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._abandon()

    def _abandon(self) -> None:
        """Cancel a sampler left in another loop (it can't be awaited from here)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            loop = task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        """End every open stream now (a server that is shutting down)."""
        self.closed = True
        if self._tick is not None:
            self._tick.set()

    async def _run(self) -> None:
        while not self.closed:
            started = time.perf_counter()
            snapshot = self.sample()
            if self.clients and time.monotonic() >= self._next_sharing:
                snapshot = {**snapshot, "sharing": self.analyse_sharing()}
                self._next_sharing = time.monotonic() + max(
                    SHARING_EVERY, self._sharing_cost / _MAX_SAMPLE_SHARE
                )
            self.latest_bytes = b"id: %r\n" % snapshot["t"] + _data(_encoder.encode(snapshot))
            tick, self._tick = self._tick, asyncio.Event()
            if tick is not None:
                tick.set()
            cost = time.perf_counter() - started
            await asyncio.sleep(max(self.interval, cost / _MAX_SAMPLE_SHARE) - cost)

    # -- server-sent events --------------------------------------------------------------

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        self.ensure_running()
        self.clients += 1
        try:
            if self.clients == 1:  # nobody watched: the sharing analysis is old, redo it
                self._next_sharing = 0.0
            init = self.init_message(_last_event(request))
            yield b"retry: 1000\nevent: init\n" + _data(_encoder.encode(init))
            while not self.closed:
                if self._tick is None:
                    self._tick = asyncio.Event()
                tick = self._tick
                try:
                    await asyncio.wait_for(tick.wait(), timeout=15.0)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if self.closed or await request.is_disconnected():
                    return
                yield self.latest_bytes
        finally:
            self.clients -= 1


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _data(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _last_event(request: Request) -> float | None:
    """The id (a snapshot's time) an EventSource that reconnects says it saw last."""
    try:
        return float(request.headers.get("last-event-id", ""))
    except ValueError:
        return None


def _engine(ranks: dict[int, EngineFigures] | None) -> dict[str, Any] | None:
    """What the engine's own /metrics said (None: not scraped): KV-cache usage (the fullest
    rank), prefix-cache hit rate (hits over queries since the last scrape, the mean over
    ranks; else since the engine started, summed over ranks), pool capacity in blocks
    (summed over ranks), load."""
    if not ranks:
        return None
    figures = list(ranks.values())
    usage = [f.kv_usage for f in figures if f.kv_usage is not None]
    capacity = [f.capacity_blocks for f in figures if f.capacity_blocks is not None]
    queries = sum(f.queries or 0 for f in figures)
    hits = sum(f.hits or 0 for f in figures)
    windowed = [f.hit_rate for f in figures if f.hit_rate is not None]
    return {
        "kv_usage": max(usage) if usage else None,
        "hit_rate": (
            sum(windowed) / len(windowed) if windowed else (hits / queries if queries else None)
        ),
        "pool_blocks": sum(capacity) if capacity else None,
        "waiting": sum(f.waiting or 0 for f in figures),
        "running": sum(f.running or 0 for f in figures),
    }


def _header(fleet: FleetSummary, rows: list[dict[str, Any]]) -> dict[str, Any]:
    stores = sum(r["stores_per_s"] for r in rows)
    removes = sum(r["removes_per_s"] for r in rows)
    return {
        "instances": fleet.instances,
        "statuses": {s.value: n for s, n in fleet.statuses.items() if n},
        "blocks": fleet.blocks,
        "blocks_by_medium": fleet.blocks_by_medium,
        "blocks_by_tier": fleet.blocks_by_tier,
        "stores_per_s": round(stores, 2),
        "removes_per_s": round(removes, 2),
        "events_per_s": round(stores + removes, 2),
        "ingest_lag_s": fleet.ingest_lag_seconds,
        "backlog": fleet.backlog,
        **fleet.counters,
    }


def _sharing_dict(result: Sharing) -> dict[str, Any]:
    return {
        "instances": result.instances,
        "overlap": result.overlap,
        "prefixes": [
            {
                "lora_name": p.lora_name,
                "block_size": p.block_size,
                "blocks": p.blocks,
                "instances": list(p.instances),
                "score": p.score,
                "token_ids": p.token_ids,
            }
            for p in result.prefixes
        ],
        "nodes": result.nodes,
        "complete": result.complete,
        "shared": result.shared,
        "everywhere": result.everywhere,
    }


# -- routes ------------------------------------------------------------------------------


def install_dashboard(
    app: FastAPI,
    fleet: Fleet,
    engines: MetricsScraper | None = None,
    max_streams: int = DEFAULT_MAX_STREAMS,
) -> Dashboard:
    """Add the dashboard's routes to `app`, and its sampler to the app's lifespan;
    `max_streams` event streams at once (the next is refused, 503)."""
    dashboard = Dashboard(fleet, engines=engines, max_streams=max_streams)
    app.state.dashboard = dashboard
    _wrap_lifespan(app, dashboard)
    _add_page_routes(app)
    _add_data_routes(app, dashboard)
    return dashboard


def _wrap_lifespan(app: FastAPI, dashboard: Dashboard) -> None:
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            dashboard.ensure_running()  # history from the start, not from the first viewer
            try:
                yield state
            finally:
                await dashboard.stop()

    app.router.lifespan_context = lifespan


def _add_page_routes(app: FastAPI) -> None:
    page = render_dashboard()
    assets = {name: _static(name) for name in _ASSETS}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        body = assets.get(name)
        if body is None:
            return Response(b'{"error": "no such file"}', 404, media_type="application/json")
        return Response(body, media_type=_ASSETS[name], headers={"Cache-Control": "no-cache"})


def _add_data_routes(app: FastAPI, dashboard: Dashboard) -> None:
    # Not in the OpenAPI schema: an endless stream is no request/answer operation.
    @app.get("/v1/dashboard/stream", response_class=StreamingResponse, include_in_schema=False)
    async def stream(request: Request) -> Response:
        """Server-sent events: `init` (history, trends, sharing), then a snapshot a second;
        503 while `max_streams` are open (each holds a connection and a task)."""
        if dashboard.streams >= dashboard.max_streams:
            body = _encoder.encode(
                {"error": f"{dashboard.max_streams} dashboard streams are open: try again later"}
            )
            headers = {"Retry-After": "5"}
            return Response(body, 503, media_type="application/json", headers=headers)
        dashboard.streams += 1  # given back when the response ends, however it ends
        return _CountedStream(
            dashboard,
            dashboard.stream(request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/v1/dashboard/snapshot")
    async def snapshot() -> Response:
        """What the stream's `init` event carries, as one JSON answer."""
        if not dashboard.running:
            dashboard.sample()  # nobody samples in this loop: read the fleet now
        body = _encoder.encode(dashboard.init_message())
        return Response(body, media_type="application/json")

    @app.get("/v1/dashboard/prompts")
    async def prompts() -> Response:
        """Recent prompts to try in the lookup box (empty unless the app has a source)."""
        source: Callable[[], list[dict[str, Any]]] | None = getattr(
            app.state, "recent_prompts", None
        )
        found = source() if source is not None else []
        return Response(_encoder.encode({"prompts": found}), media_type="application/json")


class _CountedStream(StreamingResponse):
    """A stream that counts itself in `Dashboard.streams` until it ends (the route counted
    it in: a response returned is always called)."""

    def __init__(self, dashboard: Dashboard, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.dashboard = dashboard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.dashboard.streams -= 1


def _load(view: InstanceView) -> dict[str, Any] | None:
    """The instance's load over its ranks (None if its engine sends no load stream):
    requests running and waiting summed, the fullest rank's KV usage, each rank's reading."""
    loads = [(rank.rank, rank.load) for rank in view.ranks if rank.load is not None]
    if not loads:
        return None
    usages = [load.kv_usage for _, load in loads if load.kv_usage is not None]
    return {
        "running": sum(load.running_requests for _, load in loads),
        "waiting": sum(load.waiting_requests for _, load in loads),
        "kv_usage": max(usages, default=None),
        "ranks": [
            {
                "rank": rank,
                "running": load.running_requests,
                "waiting": load.waiting_requests,
                "kv_usage": load.kv_usage,
            }
            for rank, load in loads
        ],
    }
