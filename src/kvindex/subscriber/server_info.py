"""An SGLang engine's publishers, read from its `/server_info` (`NAME=sglang+http://...`).

SGLang (0.5.23+) describes its KV-event publishers under the `kv_events` key of
`GET /server_info` (`describe_kv_events_publisher`; `null` when publishing is off):

    {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
     "replay_endpoint_port_base": 5558, "topic": "", "block_size": 16, "dp_size": 2,
     "load_endpoint_port_base": 5560, "load_topic": "load"}

Rank r publishes on base + r (PUB, replay ROUTER and load PUB alike). A wildcard host
(`*`, `0.0.0.0`, `::`) means the worker's own host: the one in the URL. The replay and load
keys are there only when configured. `fetch_descriptor` reads it (with `Authorization:
Bearer KEY` when the spec names a key), `resolve` turns it into the spec to follow, and
every way it can fail is a `DiscoveryError` whose message is one line a person can act on.
"""

from __future__ import annotations

import dataclasses
import enum
import urllib.error
import urllib.request

import msgspec

from kvindex.security.credentials import (
    CredentialError,
    api_key_from_env,
    read_key_file,
    registry,
)
from kvindex.subscriber.spec import InstanceSpec, SpecError

__all__ = [
    "KV_EVENTS_FLAG",
    "DiscoveryError",
    "Failure",
    "KvEventsDescriptor",
    "api_key",
    "fetch_descriptor",
    "resolve",
]

# What to tell the operator of an engine that publishes nothing.
KV_EVENTS_FLAG = (
    '--kv-events-config \'{"publisher": "zmq", "endpoint": "tcp://*:5557", '
    '"replay_endpoint": "tcp://*:5558"}\''
)
_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
_MAX_ANSWER = 4 * 1024 * 1024  # /server_info is a few kilobytes
# Engines are dialled directly, as their ZMQ publishers are: a proxy from the environment
# (http_proxy) would stand between kvindex and a worker on the cluster's own network.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Failure(enum.StrEnum):
    """Why a read of /server_info gave no publishers."""

    DOWN = "down"  # nothing answered (refused, timed out, no such host): retried
    BAD_ANSWER = "bad_answer"  # an answer that is no /server_info (or an HTTP error): retried
    NO_KV_EVENTS = "no_kv_events"  # the engine runs without --kv-events-config
    API_KEY = "api_key"  # the key was refused, or could not be read

    @property
    def is_setup(self) -> bool:
        """A mistake of configuration (retrying alone won't help): an error at start."""
        return self in (Failure.NO_KV_EVENTS, Failure.API_KEY)


class DiscoveryError(Exception):
    """/server_info gave no publishers; `str()` is one line saying why and what to do."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


class KvEventsDescriptor(msgspec.Struct, frozen=True):
    """`/server_info`'s `kv_events`, as SGLang's `describe_kv_events_publisher` writes it."""

    publisher: str
    endpoint_host: str
    endpoint_port_base: int
    topic: str = ""
    block_size: int | None = None
    dp_size: int = 1
    replay_endpoint_port_base: int | None = None
    load_endpoint_port_base: int | None = None
    load_topic: str | None = None


def api_key(spec: InstanceSpec) -> str | None:
    """The engine's API key: the spec's credential's (kvindex.security.credentials), or
    from the environment variable or file an operator's spec names. One printable line;
    every failure a `DiscoveryError` naming the setting, never the contents."""
    try:
        if spec.credential is not None:
            return registry.get(spec.credential).api_key()
        if spec.api_key_env is not None:
            return api_key_from_env(spec.api_key_env, f"api_key_env={spec.api_key_env}")
        if spec.api_key_file is not None:
            return read_key_file(spec.api_key_file, "api_key_file=")
    except CredentialError as exc:
        raise DiscoveryError(Failure.API_KEY, str(exc)) from None
    return None


def server_info_url(spec: InstanceSpec) -> str:
    if spec.base_url is None:
        raise ValueError(f"{spec.name} is not named by its URL")
    return spec.base_url + "/server_info"


def fetch_descriptor(spec: InstanceSpec, timeout: float = 3.0) -> KvEventsDescriptor:
    """Read the engine's `kv_events` descriptor; raises `DiscoveryError`."""
    url = server_info_url(spec)
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    key = api_key(spec)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with _opener.open(request, timeout=timeout) as answer:
            body = answer.read(_MAX_ANSWER + 1)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            how = "refused the API key" if key is not None else "wants an API key"
            raise DiscoveryError(
                Failure.API_KEY,
                f"{url} {how} (HTTP {exc.code}): give it with credential= (or, in serve's "
                "config, api_key_env= or api_key_file=)",
            ) from None
        raise DiscoveryError(Failure.BAD_ANSWER, f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DiscoveryError(Failure.DOWN, f"{url} does not answer: {reason}") from None
    except ValueError:  # http.client's message quotes the header: never passed on
        raise DiscoveryError(
            Failure.API_KEY, f"{url}: the API key can't be sent (not a valid header value)"
        ) from None
    if len(body) > _MAX_ANSWER:
        raise DiscoveryError(Failure.BAD_ANSWER, f"{url} answered more than {_MAX_ANSWER} bytes")
    return _descriptor(url, body)


def _descriptor(url: str, body: bytes) -> KvEventsDescriptor:
    try:
        info = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise DiscoveryError(Failure.BAD_ANSWER, f"{url} did not answer JSON") from None
    if not isinstance(info, dict) or "kv_events" not in info:
        raise DiscoveryError(
            Failure.BAD_ANSWER,
            f"{url} has no kv_events key: not an SGLang engine (0.5.23 or later)?",
        )
    if info["kv_events"] is None:
        raise DiscoveryError(
            Failure.NO_KV_EVENTS,
            f"{url}: the engine publishes no KV events; start it with {KV_EVENTS_FLAG}",
        )
    try:
        return msgspec.convert(info["kv_events"], KvEventsDescriptor)
    except msgspec.ValidationError as exc:
        raise DiscoveryError(Failure.BAD_ANSWER, f"{url}: kv_events is not usable: {exc}") from None


def resolve(spec: InstanceSpec, descriptor: KvEventsDescriptor) -> InstanceSpec:
    """The spec to follow: the descriptor's ports on the worker's host (a wildcard host is
    the URL's). Raises `DiscoveryError` for a descriptor no publisher can be made of."""
    url = server_info_url(spec)
    if descriptor.publisher != "zmq":
        raise DiscoveryError(
            Failure.NO_KV_EVENTS,
            f"{url}: KV events go to a {descriptor.publisher!r} publisher, not zmq; "
            f"start the engine with {KV_EVENTS_FLAG}",
        )
    host = _host(descriptor.endpoint_host, spec.url_host or "")

    def endpoint(port: int | None) -> str | None:
        return None if port is None else f"tcp://{host}:{port}"

    try:
        return dataclasses.replace(
            spec,
            endpoint=endpoint(descriptor.endpoint_port_base) or "",
            replay_endpoint=endpoint(descriptor.replay_endpoint_port_base),
            topic=descriptor.topic,
            dp=descriptor.dp_size,
            load_endpoint=endpoint(descriptor.load_endpoint_port_base),
            load_topic=descriptor.load_topic or "",
            block_size=descriptor.block_size,
        )
    except SpecError as exc:
        raise DiscoveryError(Failure.BAD_ANSWER, f"{url}: kv_events can't be used: {exc}") from None


def _host(advertised: str, url_host: str) -> str:
    if advertised in _WILDCARDS:
        return url_host
    if ":" in advertised and not advertised.startswith("["):
        return f"[{advertised}]"  # an IPv6 literal, as ZMQ wants it
    return advertised
