"""`kvindex serve`: follow a fleet of vLLM instances and answer over HTTP.

Instances come from `--instance SPEC` flags and/or a TOML file; more can be added and
removed at runtime through the API. The HTTP server (uvicorn) runs on uvloop's loop when
it is installed (KVINDEX_LOOP=asyncio: asyncio's own); ingest runs on its own threads (see
`kvindex.runtime`). The listening socket is bound here, before uvicorn starts, so a busy
port is a one-line usage error and `--http HOST:0` picks a free port that the start line
reports.

The config file (`--config`) takes every option: see `kvindex.cli.config` and
docs/configuration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvindex.cli import config
from kvindex.cli.common import (
    UsageError,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    run_async,
)
from kvindex.cli.config import DEFAULT_HTTP, DEFAULT_STORE, MAX_DEFAULT_SHARDS, Settings
from kvindex.cli.httpopts import add_http_arguments, http_options, warn_if_exposed
from kvindex.cli.signals import Stop, stop_signals
from kvindex.subscriber import CapacityError, InstanceSpec, Notice, SpecError

if TYPE_CHECKING:
    import uvicorn

    from kvindex.cli.httpopts import HttpOptions
    from kvindex.index import FleetIndex
    from kvindex.runtime import Fleet
    from kvindex.runtime.finders import Reconciler
    from kvindex.security.engines import EngineHosts
    from kvindex.service.lookupd import LookupThread
    from kvindex.service.lookups import Routing
    from kvindex.store import LoadResult, Store

DNS_INTERVAL = 10.0  # seconds between two resolutions of a --discover dns: name (default)

__all__ = ["DEFAULT_HTTP", "DEFAULT_STORE", "Settings", "add_parser", "parse_http", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="index a fleet's KV-cache events and answer over HTTP",
        description="Follow vLLM instances' KV-cache events and serve the index over HTTP "
        "(/v1/instances, /v1/lookup, /v1/stats, /metrics, /docs).",
    )
    p.add_argument("--config", metavar="FILE.toml", type=Path, help="TOML config file")
    p.add_argument(
        "--instance",
        metavar="SPEC",
        action="append",
        default=[],
        help="NAME=PUB_ENDPOINT[,replay=EP][,topic=T][,dp=N][,load=EP], or an SGLang "
        "engine by its URL: NAME=sglang+http://HOST:PORT[,api_key_env=VAR|,api_key_file=PATH]"
        "; repeatable",
    )
    _add_engine_arguments(p)
    _add_lookup_arguments(p)
    add_http_arguments(p)
    p.set_defaults(run=run)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Where the engines and the state are: the store, the listen address, ingest, discovery."""
    p.add_argument("--store", metavar="URL", help=f"state store (default: {DEFAULT_STORE})")
    p.add_argument("--http", metavar="HOST:PORT", help=f"listen address (default: {DEFAULT_HTTP})")
    p.add_argument(
        "--ingest-workers",
        metavar="N",
        type=_workers,
        help="threads that read and apply the engines' events, the instances split between "
        "them (default: one per core)",
    )
    p.add_argument(
        "--index-shards",
        metavar="N",
        type=_workers,
        help="split the index by instance into N shards, each applied by ingest workers of "
        "its own (worker i applies into shard i %% N; the workers default to N when this is "
        "given): ingest scales with cores, a lookup walks every shard (docs/performance.md). "
        "Memory and SQLite stores (default: one per ingest worker, at most "
        f"{MAX_DEFAULT_SHARDS}; 1 with a Redis store or the pure index)",
    )
    p.add_argument(
        "--sub-hwm",
        metavar="N",
        type=positive_int,
        help="live messages queued per publisher before ZMQ drops new ones (then replayed, "
        "or counted lost); default 100000 (docs/configuration.md)",
    )
    p.add_argument(
        "--discovery-interval",
        metavar="S",
        type=non_negative_seconds,
        help="seconds between two reads of a well SGLang engine's /server_info (instances "
        "named by sglang+http://), to follow a changed DP size or ports; 0 = only on a "
        "restart or link trouble (default 30); also how often --discover dns: resolves "
        "again (default 10 there)",
    )
    p.add_argument(
        "--discover",
        metavar="SOURCE",
        action="append",
        default=[],
        help="find engines instead of naming them: 'k8s:NAMESPACE?selector=LABELS' (pods, "
        "list + watch) or 'dns:HOST[:PORT]' (A/AAAA/SRV, re-resolved every "
        "--discovery-interval); repeatable (docs/discovery.md)",
    )
    p.add_argument(
        "--min-engines",
        metavar="N",
        type=positive_int,
        help="/healthz says 'starting' (503) until N engines found by --discover are live",
    )
    p.add_argument(
        "--idle-grace",
        metavar="S",
        type=positive_seconds,
        help="seconds an engine's KV usage may read 0 while kvindex holds GPU blocks for it "
        "before that is logged and counted (its blocks are kept; default 60)",
    )
    p.add_argument(
        "--engine-hosts",
        metavar="HOSTS",
        type=_host_list,
        help="the hosts an API client's engine specs may name (comma-separated: names, "
        "*.SUFFIX, IP addresses, networks such as 10.0.0.0/8, or '*' for any); the hosts of "
        "configured engines are always allowed; default: those, plus the loopback when the "
        "API listens on the loopback only (docs/security.md)",
    )


def _add_lookup_arguments(p: argparse.ArgumentParser) -> None:
    """How lookups and routing answer: tokenizers, the score's weights, the lookup thread."""
    p.add_argument(
        "--tokenizer",
        metavar="MODEL=PATH|vllm",
        action="append",
        default=[],
        help="how MODEL's prompts become token ids for lookups by text: a Hugging Face model "
        "directory or tokenizer.json (the tokenize extra), or 'vllm' for the instance's own "
        "POST /tokenize (its spec's http=); repeatable",
    )
    p.add_argument(
        "--tokenizer-cache-mb",
        metavar="MIB",
        type=_cache_mb,
        help="memory for each local tokenizer's prefix cache: a text's already tokenized "
        "prefix is not tokenized again (default 64; 0: off; docs/routing.md)",
    )
    p.add_argument(
        "--weights",
        metavar="NAME=VALUE[,...]",
        action="append",
        type=config.parse_weights,
        help="the routing score's weights: prefix, queue, running, kv, backlog, predicted, and the "
        "tiers gpu, cpu, disk, external (docs/routing.md); the others keep their defaults; "
        "repeatable",
    )
    p.add_argument(
        "--prediction-ttl",
        metavar="SECONDS",
        type=positive_seconds,
        help="how long POST /v1/route's choice counts as predicted blocks on the chosen "
        "instance, unless its real blocks show first (default 2)",
    )
    p.add_argument(
        "--local-hashes",
        action="store_true",
        help="keep Dynamo's local block hashes of every cached block, so the peers' POST "
        "/query_by_hash answers (about 30 bytes a block more, a quarter less ingest "
        "throughput; docs/routing.md)",
    )
    p.add_argument(
        "--lookup-thread",
        choices=("on", "off"),
        help="on (the default): a C thread on the listening socket answers plain POST "
        "/v1/lookup and /v1/lookup/hashes requests without the GIL, Python the rest; off: "
        "Python answers every request (docs/performance.md)",
    )


def _host_list(text: str) -> list[str]:
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("must be host names, addresses or networks, by commas")
    return entries


# -- settings ----------------------------------------------------------------------------


def settle_shards(settings: Settings) -> None:
    """The index's shards: not given, set to `default_shards`; given, checked (the compiled
    core, a store that applies in this process alone, an ingest worker per shard at least)."""
    from kvindex.index import COMPILED

    shards = settings.index_shards
    shared = settings.store.startswith(("redis://", "redis+sentinel://"))
    if shards is None:
        workers = settings.ingest_workers
        settings.index_shards = 1 if shared or not COMPILED else default_shards(workers)
        return
    if shards == 1:
        return
    if not COMPILED:
        raise UsageError("--index-shards needs the compiled core (this is the pure index)")
    if shared:
        raise UsageError("--index-shards takes the memory or SQLite store, not Redis")
    if settings.ingest_workers is not None and settings.ingest_workers < shards:
        raise UsageError(
            f"--index-shards {shards} takes {shards} ingest workers at least, "
            f"not {settings.ingest_workers}"
        )


def default_shards(workers: int | None) -> int:
    """The index's shards when not given: one per ingest worker (the workers' default: one
    per core), at most MAX_DEFAULT_SHARDS."""
    from kvindex.runtime.ingest import default_workers

    return min(workers if workers is not None else default_workers(), MAX_DEFAULT_SHARDS)


def _workers(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 256, got {text!r}")
    return int(text)


def load_settings(args: argparse.Namespace) -> Settings:
    """The config file (if any), then the flags; every problem is a UsageError."""
    settings = config.load_settings(args)
    check_store(settings.store)
    settle_shards(settings)
    parse_http(settings.http)
    return settings


def check_store(url: str) -> None:
    """A store URL of a known kind (opening it happens when serving starts)."""
    from kvindex.store import StoreError, open_store

    try:
        open_store(url)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def parse_http(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:8080`) -> (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--http {text!r} must be HOST:PORT, e.g. {DEFAULT_HTTP}")
    return host, int(port)


# -- running -----------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so a busy or unknown address is a usage error, not a crash."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, IndexError) as exc:
        raise UsageError(f"can't listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"can't listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}/" if ":" in host else f"{scheme}://{host}:{port}/"


def run(args: argparse.Namespace) -> int:
    # From the start: a signal during a long warm start stops it too, and a second one
    # still forces the exit while the store closes.
    with stop_signals("serve") as stop:
        return _run(args, stop)


def _run(args: argparse.Namespace, stop: Stop) -> int:
    settings = load_settings(args)
    host, port = parse_http(settings.http)
    http = http_options(args, settings.http_options, bind_host=host)
    warn_if_exposed(host, http)
    install_engine_hosts(settings, host)
    logging.basicConfig(level=logging.WARNING, format="kvindex serve: %(levelname)s %(message)s")
    # Ingest threads and the HTTP loop share the GIL: a lookup waiting for it would wait up
    # to a whole switch interval (5 ms by default) behind an ingest thread's Python work.
    sys.setswitchinterval(float(os.environ.get("KVINDEX_SWITCH_INTERVAL", "0.0005")))
    configured = check_discovered(settings.instances)
    store, index, loaded = _open_store_importing(
        settings.store, settings.local_hashes, settings.index_shards
    )
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(store.close)
        sock = listen(host, port)
        on_failure.callback(sock.close)
        instances = _with_runtime_instances(configured, loaded.instances)
        fleet = _start_fleet(settings, instances, store, index, loaded)
        on_failure.callback(fleet.close)
        starting = _StoreStart(store)  # while the app is built (after a shared store's share)
        on_failure.callback(starting.join)  # before the store closes
        finders = _finders(fleet, settings)
        routing = _routing(fleet, settings)
        on_failure.pop_all()  # from here on, serving owns them
    server = _server(fleet, routing, store, http, stop, finders)
    lookups = _lookup_thread(settings, fleet, sock, http, server)
    starting.wait()  # the store is taking items before ingest starts
    try:
        run_async(_serve(server, sock, _summary(len(instances), store.url, loaded), lookups))
    finally:
        store.close()
    return 0


def install_engine_hosts(settings: Settings, api_host: str) -> EngineHosts:
    """The engine allow-list an API client's specs are held to (kvindex.security.engines):
    the operator's list, or by default the loopback when the API listens on the loopback
    only; plus every host a configured engine is on."""
    from kvindex.security.engines import DEFAULT_SCHEMES, LOOPBACK, EngineHosts, engine_hosts

    entries = list(settings.engine_hosts or [])
    if settings.engine_hosts is None and _is_loopback(api_host):
        entries += LOOPBACK
    hosts = EngineHosts(entries, settings.engine_schemes or DEFAULT_SCHEMES)
    for spec in settings.instances:
        for found in spec.hosts():
            hosts.add(found, "config")
    engine_hosts.install(hosts)
    return hosts


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _start_fleet(
    settings: Settings,
    instances: list[InstanceSpec],
    store: Store,
    index: FleetIndex,
    loaded: LoadResult,
) -> Fleet:
    """The fleet that follows `instances` from the store's checkpoints, its items handed to
    the store (a usage error when its sockets can't be had)."""
    import zmq

    from kvindex.runtime import Fleet
    from kvindex.runtime.discovery import DEFAULT_INTERVAL

    shared = store.shared()  # Redis: other replicas too
    interval = settings.discovery_interval
    try:
        fleet = Fleet(
            instances,
            index=index,
            resume=loaded.checkpoints,
            keep_payload=store.url != "memory",
            subscriber=shared.subscriber if shared else None,
            membership=shared.membership if shared else None,
            ingest_workers=settings.ingest_workers,
            sub_hwm=settings.sub_hwm,
            discovery_interval=DEFAULT_INTERVAL if interval is None else interval,
        )
    except CapacityError as exc:  # it says what, the limit and how to raise it
        raise UsageError(str(exc)) from None
    except zmq.ZMQError as exc:
        raise UsageError(f"can't follow the instances: {exc}") from None
    if settings.idle_grace is not None:
        fleet.idle_grace = settings.idle_grace
    if store.url != "memory":  # the memory store records nothing
        fleet.record_into(store.record, store.record_batches)
    fleet.on_read.append(store.flush)
    fleet.on_remove.append(store.remove_instance)
    fleet.on_add.append(store.save_instance)
    fleet.add_link_hook(_warn_link)  # can't follow a publisher; its replay refused
    if shared is not None:
        shared.share(fleet.specs.values())
    return fleet


def _finders(fleet: Fleet, settings: Settings) -> Reconciler | None:
    """The `--discover` finders on one reconciler (started with the service), or None."""
    from kvindex.runtime.finders import Reconciler, finder_of

    if not settings.discover:
        if settings.min_engines:
            raise UsageError("--min-engines counts engines found by --discover: give one")
        return None
    reconciler = Reconciler(fleet, min_engines=settings.min_engines or 0)
    interval = settings.discovery_interval or DNS_INTERVAL
    for text in settings.discover:
        try:
            finder = finder_of(text, reconciler, interval=interval, dns_server=settings.dns_server)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        reconciler.finders.append(finder)
    return reconciler


def _routing(fleet: Fleet, settings: Settings) -> Routing:
    from kvindex.runtime.routing import DEFAULT_TTL, Predictions, Weights
    from kvindex.service.lookups import Routing

    return Routing.of(
        fleet,
        _tokenizers(fleet, settings.tokenizers, settings.tokenizer_cache_mb),
        weights=Weights.of(settings.weights),
        predictions=Predictions(settings.prediction_ttl or DEFAULT_TTL),
    )


def _server(
    fleet: Fleet,
    routing: Routing,
    store: Store,
    http: HttpOptions,
    stop: Stop,
    finders: Reconciler | None = None,
) -> uvicorn.Server:
    """The HTTP app on uvicorn, plain lookups answered in its protocol."""
    import uvicorn

    from kvindex.service.app import create_app
    from kvindex.service.fastpath import lookup_protocol

    app = create_app(
        fleet,
        guard=http.guard,
        max_body_bytes=http.max_body_bytes,
        store_health=store.health,
        routing=routing,
        finders=finders,
    )
    protocol = lookup_protocol(
        app.state.lookup_answerer, http.guard, http.max_body_bytes, http.limits
    )
    config = uvicorn.Config(
        app,
        **http.uvicorn_kwargs(),
        http=protocol,  # plain lookups answered in the protocol (see service.fastpath)
        loop="asyncio",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return make_server(config, stop, _end_streams(app), http.limits.tls_handshake_timeout)


def _lookup_thread(
    settings: Settings,
    fleet: Fleet,
    sock: socket.socket,
    http: HttpOptions,
    server: uvicorn.Server,
) -> LookupThread | None:
    """The C thread that answers plain lookups on `sock` (kvindex.service.lookupd), or
    None: asked not to, no compiled core, or TLS (the thread speaks plain HTTP)."""
    from kvindex.service.lookupd import LookupThread, LookupThreadCollector, available

    config = server.config
    if not settings.lookup_thread or not available(fleet) or config.is_ssl:
        return None
    config.load()  # its default headers, as uvicorn's protocol writes them
    app: Any = config.app
    metrics = app.state.lookup_answerer.metrics
    lookups = LookupThread(
        fleet,
        sock,
        http.guard,
        http.max_body_bytes,
        metrics.lookups,
        config.encoded_headers,
        date_header=config.date_header,
        keep_alive=config.timeout_keep_alive,
        limits=http.limits,
    )
    metrics.before_render.append(lookups.read_samples)
    metrics.registry.register(LookupThreadCollector(lookups))
    server.before_shutdown.append(lookups.stop)  # type: ignore[attr-defined]
    return lookups


def _summary(instances: int, store_url: str, loaded: LoadResult) -> str:
    """The start line's tail: what is followed, where state is kept, what the warm start
    brought back."""
    summary = f"{instances} instance(s), store {store_url}"
    if loaded.blocks_restored or loaded.log_batches_replayed:
        summary += (
            f", warm start: {loaded.blocks_restored} blocks + "
            f"{loaded.log_batches_replayed} logged batches in {loaded.seconds:.2f} s"
        )
    return summary


def _cache_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of MiB, 0 or more")
    return value


def _tokenizers(fleet: Any, options: list[str], cache_mb: float | None = None) -> Any:
    """`--tokenizer MODEL=PATH|vllm` options, loaded (a bad one is a UsageError), each
    local one with a prefix cache of `cache_mb` MiB (None: the default, 64)."""
    from kvindex.runtime.prefix_tokens import DEFAULT_MAX_BYTES
    from kvindex.runtime.tokenize import TokenizerError, Tokenizers, parse_tokenizer_option

    size = DEFAULT_MAX_BYTES if cache_mb is None else int(cache_mb * (1 << 20))
    tokenizers = Tokenizers(fleet, cache_bytes=size)
    try:
        for option in options:
            tokenizers.add(*parse_tokenizer_option(option))
    except TokenizerError as exc:
        raise UsageError(str(exc)) from None
    return tokenizers


def check_discovered(specs: list[InstanceSpec]) -> list[InstanceSpec]:
    """Engines named by their URL (SGLang), read now, all at once: a mistake of setup (no
    KV events, an API key missing or refused) is a usage error; an engine that does not
    answer is left to be found (`connecting`, one warning line, retried with backoff)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvindex.runtime.discovery import first_read
    from kvindex.subscriber.server_info import DiscoveryError

    def read(spec: InstanceSpec) -> InstanceSpec:
        try:
            return first_read(spec, timeout=3.0)
        except DiscoveryError as exc:
            if exc.failure.is_setup:
                raise UsageError(f"instance {spec.name}: {exc}") from None
            return spec  # not answering (yet): Discovery says so and keeps trying

    pending = [spec for spec in specs if spec.pending]
    if not pending:
        return specs
    with ThreadPoolExecutor(max_workers=min(16, len(pending))) as pool:
        found = {spec.name: spec for spec in pool.map(read, pending)}
    return [found.get(spec.name, spec) for spec in specs]


def _warn_link(notice: Notice) -> None:
    logging.getLogger("kvindex.serve").warning("%r: %s", notice.source, notice.describe())


def _open_store(url: str, local_hashes: bool = False) -> tuple[Store, FleetIndex, LoadResult]:
    """Open the store and load its state into a fresh index (a warm start); with
    `local_hashes`, one keeping Dynamo's local hashes (the pure index always can)."""
    from kvindex.index import FleetIndex
    from kvindex.store import StoreError, open_store

    index = FleetIndex(local_hashes=local_hashes)
    try:
        store = open_store(url)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    try:
        loaded = store.load(index)
    except StoreError as exc:
        store.close()  # frees what it took (the store's lock)
        raise UsageError(str(exc)) from None
    return store, index, loaded


# What serving imports after the warm start (the fleet, the app, uvicorn): imported while
# the store loads (see _open_store_importing). One missing is imported where it is used.
SERVING_MODULES = (
    "zmq",
    "kvindex.runtime",
    "kvindex.runtime.discovery",
    "kvindex.runtime.routing",
    "kvindex.runtime.finders",
    "kvindex.runtime.tokenize",
    "kvindex.service.lookups",
    "kvindex.service.app",
    "kvindex.service.fastpath",
    "kvindex.service.lookupd",
    "uvicorn",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on",
)


def _open_store_importing(
    url: str, local_hashes: bool = False, shards: int | None = None
) -> tuple[Store, FleetIndex, LoadResult]:
    """The store opened here (its modules imported before anything else: the load needs
    them first, and two threads never import the same modules at once), then loaded into
    a fresh index (a warm start) on a thread while this one imports what serving needs: a
    compiled index's snapshot is read and applied in C without the GIL (kvindex.store
    .sqlite.fastload), so the load and the imports (about half a second each) run side by
    side instead of one after the other. The index is whole when this returns: nothing is
    served from it before."""
    import importlib
    import threading

    from kvindex.store import StoreError, open_store

    index = _new_index(local_hashes, shards)
    try:
        store = open_store(url)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    done: list[LoadResult | BaseException] = []

    def load() -> None:
        try:
            done.append(store.load(index))
        except BaseException as exc:  # raised below, on this thread
            done.append(exc)

    loader = threading.Thread(target=load, name="kvindex-warm-start", daemon=True)
    loader.start()
    for name in SERVING_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    loader.join()
    (outcome,) = done
    if isinstance(outcome, BaseException):
        store.close()  # frees what it took (the store's lock)
        if isinstance(outcome, StoreError):
            raise UsageError(str(outcome)) from None
        raise outcome
    return store, index, outcome


def _new_index(local_hashes: bool, shards: int | None) -> FleetIndex:
    """The index a warm start loads into: one, or `shards` (kvindex.index.sharded)."""
    from kvindex.index import FleetIndex

    if shards is not None and shards > 1:
        from kvindex.index.sharded import ShardedIndex

        sharded: Any = ShardedIndex(shards, local_hashes=local_hashes)
        return cast(FleetIndex, sharded)
    return FleetIndex(local_hashes=local_hashes)


class _StoreStart:
    """`store.start()` on a thread: the SQLite writer is a Python process that takes ~0.2 s
    to say it is there, which the rest of serve's start (the fleet, the app, uvicorn's
    config) need not wait for. `wait` raises what `start` raised."""

    def __init__(self, store: Store) -> None:
        import threading

        self._failed: list[BaseException] = []

        def start() -> None:
            try:
                store.start()
            except BaseException as exc:  # raised by wait, on the caller's thread
                self._failed.append(exc)

        self._thread = threading.Thread(target=start, name="kvindex-store-start", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> None:
        self._thread.join()
        if self._failed:
            raise self._failed[0]


def _with_runtime_instances(
    configured: list[InstanceSpec], persisted: dict[str, str]
) -> list[InstanceSpec]:
    """Configured instances, plus those added through the API before a restart: held to
    what a client may give now (a spec an older version took, naming a file of the host,
    is dropped with a warning)."""
    names = {spec.name for spec in configured}
    extra = []
    for name, text in sorted(persisted.items()):
        if name in names:
            continue
        try:
            extra.append(InstanceSpec.parse(text, from_client=True))
        except SpecError as exc:
            logging.getLogger("kvindex.serve").warning(
                "instance %s from the store is not followed: %s (configure it instead)", name, exc
            )
    return [*configured, *extra]


def _end_streams(app: Any) -> Callable[[], None]:
    """From a signal handler: have the loop end the dashboard's open streams (create_app
    always installs the dashboard)."""
    dashboard = app.state.dashboard

    def end() -> None:
        try:  # the handler runs on the loop's own thread, between two of its steps
            asyncio.get_running_loop().call_soon_threadsafe(dashboard.close)
        except RuntimeError:
            pass

    return end


async def _serve(
    server: uvicorn.Server, sock: socket.socket, summary: str, lookups: LookupThread | None = None
) -> None:
    # The address is read now: a signal right after the start closes the socket before
    # this coroutine looks again (`started` stays True), and getsockname() would fail.
    url = _url(sock, server.config.is_ssl)
    # With the lookup thread, it accepts every connection and hands uvicorn those it does
    # not answer (kvindex.service.lookupd); uvicorn listens on nothing itself.
    task = asyncio.create_task(server.serve(sockets=[sock] if lookups is None else []))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started and not server.should_exit and lookups is not None:
        lookups.start(
            _protocol_factory(server, lookups.returning(server.config.http_protocol_class))
        )
    if server.started and not server.should_exit:
        print(f"kvindex serve: listening on {url} ({summary})", flush=True)
        # What exists now (the app, the warm-loaded state) lives as long as the process:
        # keep it out of every later full collection, which would only walk it again.
        gc.freeze()
    try:
        await task
    finally:
        if lookups is not None:
            lookups.stop()
        sock.close()


def _protocol_factory(server: uvicorn.Server, cls: type[Any]) -> Callable[[], asyncio.Protocol]:
    """`cls` (uvicorn's protocol or a subclass) for one connection, as uvicorn's server
    makes its protocols (`startup`)."""
    config = server.config

    def protocol() -> asyncio.Protocol:
        made: asyncio.Protocol = cls(
            config=config, server_state=server.server_state, app_state=server.lifespan.state
        )
        return made

    return protocol


def make_server(
    config: uvicorn.Config,
    stop: Stop,
    on_stop: Callable[[], None] | None = None,
    tls_handshake_timeout: float | None = None,
) -> uvicorn.Server:
    """uvicorn's server, stopped by `stop` (the command's signal handling, see
    `kvindex.cli.signals`) instead of its own handlers, which would re-raise the caught
    signal after a graceful stop (turning a clean SIGTERM shutdown into death by signal)
    and only make a second one skip waiting for connections. `on_stop` runs on the first
    signal, from the signal handler (e.g. to end the dashboard's streams, which would hold
    a graceful shutdown open). With TLS, a handshake not done in `tls_handshake_timeout`
    seconds closes its connection (asyncio's default is a minute)."""
    import uvicorn

    class Server(uvicorn.Server):
        # What must stop before uvicorn closes its connections (the lookup thread).
        before_shutdown: list[Callable[[], None]] = []

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            if not sockets or not self.config.is_ssl or tls_handshake_timeout is None:
                await super().startup(sockets)
                return
            # uvicorn's own start with no socket, then its listeners made here: uvicorn
            # gives asyncio no handshake timeout.
            await super().startup([])
            if self.should_exit:
                return
            loop = asyncio.get_running_loop()
            protocol = _protocol_factory(self, self.config.http_protocol_class)
            for sock in sockets:
                listener = await loop.create_server(
                    protocol,
                    sock=sock,
                    ssl=self.config.ssl,
                    backlog=self.config.backlog,
                    ssl_handshake_timeout=tls_handshake_timeout,
                )
                self.servers.append(listener)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for step in self.before_shutdown:
                step()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            def exit_soon() -> None:
                self.should_exit = True
                if on_stop is not None:
                    on_stop()

            with stop.calling(exit_soon):
                yield

    server = Server(config)
    server.before_shutdown = []
    return server
