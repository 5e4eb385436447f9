"""Which publishers to follow: `NAME=PUB[,replay=REPLAY][,topic=TOPIC][,dp=RANKS]`, plus
`curve=SERVER_KEY_OR_FILE[,client_key=FILE]` for a CURVE-encrypted link (`kvindex relay`),
and `load=LOAD_PUB` for SGLang's load stream (rank r on its port + r).

What a router needs beside the stream: `model=MODEL` (the model the engine serves: lookups
that name a model see only its instances), `http=URL` (the engine's own HTTP server, for
`POST /tokenize` and, by default, `/metrics`), `metrics=URL` (where its Prometheus
metrics are, if not at `http`'s `/metrics`), and what the peers' `/register` says of a
worker: `routing_group=GROUP` (Dynamo's routing group; none: `default`) and
`block_size=N` (its tokens per block, before its first BlockStored shows it). Being in
the spec, they are kept by the store with the instance and come back after a restart.

DP ranks are on ports +0..+dp-1 of both endpoints, as vLLM binds them; a rank elsewhere is
named by `rank@R=PUB` and `replay@R=REPLAY` (the peers' `/register` gives an endpoint per
rank), and `rank=R` says which rank the main endpoint is (0 by default).

An SGLang engine can also be named by its URL, `NAME=sglang+http://HOST:PORT` (or
`https`), with `api_key_env=VAR` or `api_key_file=PATH` when its API wants a key (never
the key itself: a command line is visible to every user of the machine): its publishers
are read from its `/server_info` (`kvindex.subscriber.server_info`). Until then the spec has
no endpoint and no ranks (`pending`); `resolved` fills them in, and `render` keeps giving
the URL, so a persisted spec is discovered again after a restart.

A spec from an API client (`parse(..., from_client=True)`, `client_checked`) names no file,
environment variable or key of the host: not `api_key_env=`, `api_key_file=`,
`client_key=` or a `curve=` file, only `credential=NAME`, a secret the operator defined in
serve's config file (kvindex.security.credentials); and no `ipc://` or `inproc://`
endpoint (the host's own sockets). Where it may connect is checked by the engine
allow-list (kvindex.security.engines).

An engine that publishes no KV events is `NAME=events=none[,gpu_blocks=N][,ttl=S]` (with
`model=`, `http=`, `metrics=`, `load=`, `block_size=`, `routing_group=` as for any
instance): no KV-event publisher (`sources()` is empty; its load still comes from
`metrics=`/`http=` or an SGLang `load=` stream); the router learns its cache from what
`/v1/route` sent there, in an LRU of at most `gpu_blocks` blocks (its KV pool; else what
its `/metrics` says, else `APPROX_DEFAULT_BLOCKS`) aged by `ttl` seconds (default
`APPROX_DEFAULT_TTL`), and marks
every answer from it `approximate` (kvindex.runtime.approximate).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvindex.security.credentials import CredentialError, registry
from kvindex.security.curve import CurveClient, KeyFileError, is_key, read_public_key
from kvindex.security.engines import EngineHostError, engine_hosts
from kvindex.subscriber.messages import SourceKey

__all__ = [
    "APPROX_DEFAULT_BLOCKS",
    "APPROX_DEFAULT_TTL",
    "DISCOVERY_SCHEMES",
    "InstanceSpec",
    "SourceSpec",
    "SpecError",
    "offset_endpoint",
]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")
_MAX_DP = 1024
_MAX_BLOCK_SIZE = 1 << 20
_OPTIONS = (
    "replay",
    "topic",
    "dp",
    "curve",
    "client_key",
    "model",
    "http",
    "metrics",
    "rank",
    "load",
    "routing_group",
    "block_size",
    "credential",
)
_RANK_OPTION = re.compile(r"(rank|replay)@([0-9]{1,4})")
_MODEL = re.compile(r"[^\s,=]{1,256}")
_URL = re.compile(r"https?://[^\s,/]+(/[^\s,]*)?")
_DISCOVERY_OPTIONS = ("api_key_env", "api_key_file", "model", "credential")
# What only the operator may name: the host's files, environment and keys.
_OPERATOR_OPTIONS = ("api_key_env", "api_key_file", "client_key")
_CREDENTIAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CLIENT_SCHEMES = ("tcp://",)  # an API client's ZMQ endpoints: never the host's own sockets
# `sglang+http://HOST:PORT` (an IPv6 host in brackets), an optional trailing slash.
_DISCOVER = re.compile(r"sglang\+(https?)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})/?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
DISCOVERY_SCHEMES = ("sglang+http://", "sglang+https://")
EVENTS_NONE = "events=none"
# An engine without KV events: what its spec may say beside `events=none`.
_NONE_OPTIONS = (
    "model",
    "http",
    "metrics",
    "load",
    "block_size",
    "routing_group",
    "gpu_blocks",
    "ttl",
)
APPROX_DEFAULT_BLOCKS = 65_536  # an events=none engine's pool when `gpu_blocks=` is not given
APPROX_DEFAULT_TTL = 600.0  # seconds a block routed to an events=none engine is assumed kept
_MAX_GPU_BLOCKS = 1 << 31


class SpecError(ValueError):
    """An instance spec or endpoint that can't be used; the message says why."""


def _check_endpoint(endpoint: str, what: str) -> str:
    if not _ENDPOINT.fullmatch(endpoint):
        raise SpecError(f"{what} {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SpecError(f"{what} {endpoint!r} needs a host and a port (tcp://HOST:PORT)")
    return endpoint


def _check_url(url: str, what: str) -> str:
    if not _URL.fullmatch(url):
        raise SpecError(f"{what} {url!r} is not an http(s) URL (http://HOST:PORT[/PATH])")
    return url


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint DP rank `rank` uses, as vLLM derives it: tcp port + rank, else a suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One publisher socket pair: what a `Subscriber` connects to."""

    source: SourceKey
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    curve: CurveClient | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One vLLM instance: a name, its PUB endpoint, optional replay endpoint, topic, DP size."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp: int = 1
    curve: str | None = None  # the CURVE server's public key (Z85)
    client_key: str | None = None  # our CURVE secret key file (else an ephemeral pair)
    model: str | None = None  # the model it serves (a lookup naming a model sees its own)
    http: str | None = None  # the engine's HTTP server (vLLM: /tokenize, /metrics)
    metrics: str | None = None  # its Prometheus metrics, if not at `http` + /metrics
    rank: int = 0  # the DP rank of `endpoint` (with `extra_ranks`)
    # Ranks not on the port offsets: (rank, PUB endpoint, replay endpoint or None).
    extra_ranks: tuple[tuple[int, str, str | None], ...] = ()
    load_endpoint: str | None = None  # SGLang's load stream (rank r on its port + r)
    load_topic: str = ""
    # An engine named by its URL (`sglang+http://HOST:PORT`): its publishers come from its
    # /server_info; the API key for that, by environment variable or file.
    discover: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    # Tokens per block: as the engine advertised it (discovered engines) or `block_size=`.
    block_size: int | None = None
    routing_group: str | None = None  # the peers' routing group (None: "default")
    # A secret the operator named in serve's config ([credentials.NAME]): an SGLang
    # engine's API key, or (with curve=) our CURVE client key.
    credential: str | None = None
    # An engine that publishes no KV events (`events=none`): no publisher; its cache is
    # what the router sent there, at most `gpu_blocks` blocks, each kept `ttl` seconds.
    events_none: bool = False
    gpu_blocks: int | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise SpecError(
                f"instance name {self.name!r} must be 1-128 letters, digits or _.:@- "
                "(starting with a letter or digit)"
            )
        if self.events_none:
            self._check_events_none()
            return
        if self.gpu_blocks is not None or self.ttl is not None:
            raise SpecError("gpu_blocks= and ttl= go with events=none (an engine without events)")
        self._check_discovery()
        if self.credential is not None and not _CREDENTIAL.fullmatch(self.credential):
            raise SpecError(f"credential={self.credential!r} is not a credential's name")
        if self.pending:
            self._check_router_fields()
            return  # no publisher known yet: nothing else to check
        _check_endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            _check_endpoint(self.replay_endpoint, "replay endpoint")
        if self.load_endpoint is not None:
            _check_endpoint(self.load_endpoint, "load endpoint")
        if not 1 <= self.dp <= _MAX_DP:
            raise SpecError(f"dp must be between 1 and {_MAX_DP}, got {self.dp}")
        self._check_router_fields()
        if self.dp > 1:
            for ep in (self.endpoint, self.replay_endpoint, self.load_endpoint):
                if ep and ep.startswith("tcp://") and int(ep.rpartition(":")[2]) + self.dp > 65536:
                    raise SpecError(f"dp={self.dp} runs past port 65535 from {ep}")
        self.curve_client()  # a bad key or key file is an error now, not at connect time

    def _check_events_none(self) -> None:
        if self.endpoint or self.discover is not None or self.dp != 1 or self.extra_ranks:
            raise SpecError("events=none names no publisher (no endpoint, dp=, rank@R= or URL)")
        for option in ("replay_endpoint", "curve", "client_key", "credential"):
            if getattr(self, option) is not None:
                raise SpecError(f"events=none: {option} does not apply (no publisher)")
        if self.load_endpoint is not None:  # SGLang's load stream: load, not KV events
            _check_endpoint(self.load_endpoint, "load endpoint")
        if self.gpu_blocks is not None and not 1 <= self.gpu_blocks <= _MAX_GPU_BLOCKS:
            raise SpecError(f"gpu_blocks must be between 1 and {_MAX_GPU_BLOCKS}")
        if self.ttl is not None and not (math.isfinite(self.ttl) and 0 < self.ttl <= 1e9):
            raise SpecError(f"ttl must be a number of seconds > 0, got {self.ttl!r}")
        self._check_router_fields()

    @property
    def pool_blocks(self) -> int:
        """An events=none engine's pool: `gpu_blocks=`, else APPROX_DEFAULT_BLOCKS (until
        its `/metrics` says: Fleet.pool_state)."""
        return self.gpu_blocks if self.gpu_blocks is not None else APPROX_DEFAULT_BLOCKS

    @property
    def approx_ttl(self) -> float:
        """How long a block routed to an events=none engine is assumed kept there."""
        return self.ttl if self.ttl is not None else APPROX_DEFAULT_TTL

    def _check_router_fields(self) -> None:
        if self.model is not None and not _MODEL.fullmatch(self.model):
            raise SpecError(f"model {self.model!r} must be 1-256 characters, no spaces, ',' or '='")
        if self.http is not None:
            _check_url(self.http, "http")
        if self.metrics is not None:
            _check_url(self.metrics, "metrics")
        if self.routing_group is not None and not _MODEL.fullmatch(self.routing_group):
            raise SpecError(
                f"routing_group {self.routing_group!r} must be 1-256 characters, "
                "no spaces, ',' or '='"
            )
        if self.block_size is not None and not 1 <= self.block_size <= _MAX_BLOCK_SIZE:
            raise SpecError(f"block_size must be between 1 and {_MAX_BLOCK_SIZE}")
        if self.rank != 0 or self.extra_ranks:
            if self.dp != 1:
                raise SpecError("dp= and explicit ranks (rank=, rank@R=) don't go together")
            ranks = [self.rank, *(rank for rank, _, _ in self.extra_ranks)]
            if len(set(ranks)) != len(ranks) or not all(0 <= r < _MAX_DP for r in ranks):
                raise SpecError(f"DP ranks must be distinct, 0 to {_MAX_DP - 1}: {ranks}")
            for rank, endpoint, replay in self.extra_ranks:
                _check_endpoint(endpoint, f"rank {rank}'s endpoint")
                if replay is not None:
                    _check_endpoint(replay, f"rank {rank}'s replay endpoint")

    def ranks(self) -> list[int]:
        """The DP ranks followed, ascending."""
        if self.rank == 0 and not self.extra_ranks:
            return list(range(self.dp))
        return sorted([self.rank, *(rank for rank, _, _ in self.extra_ranks)])

    @property
    def metrics_url(self) -> str | None:
        """Where the engine's Prometheus metrics are: `metrics=`, else `http=` + /metrics."""
        if self.metrics is not None:
            return self.metrics
        return None if self.http is None else self.http.rstrip("/") + "/metrics"

    def _check_discovery(self) -> None:
        if self.discover is None:
            if self.api_key_env is not None or self.api_key_file is not None:
                raise SpecError("api_key_env= and api_key_file= go with NAME=sglang+http://...")
            if self.credential is not None and self.curve is None:
                raise SpecError("credential= goes with curve= (its client_key) or sglang+http://")
            return
        if self.credential is not None and (self.api_key_env or self.api_key_file):
            raise SpecError("give credential= or api_key_env=/api_key_file=, not both")
        if not _DISCOVER.fullmatch(self.discover):
            raise SpecError(
                f"{self.discover!r} must look like sglang+http://HOST:PORT (or sglang+https)"
            )
        port = int(_DISCOVER.fullmatch(self.discover).group(3))  # type: ignore[union-attr]
        if not 0 < port < 65536:
            raise SpecError(f"{self.discover!r}: port {port} is not a TCP port")
        if self.api_key_env is not None and self.api_key_file is not None:
            raise SpecError("give api_key_env= or api_key_file=, not both")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            raise SpecError(f"api_key_env={self.api_key_env!r} is not an environment variable")
        if self.api_key_file == "":
            raise SpecError("api_key_file= needs a path")
        if self.curve is not None or self.client_key is not None:
            raise SpecError("SGLang's publishers speak plain ZMQ: curve= does not apply")

    @property
    def pending(self) -> bool:
        """An engine named by its URL whose publishers are not known yet (no ranks)."""
        return self.discover is not None and not self.endpoint

    @property
    def base_url(self) -> str | None:
        """The engine's HTTP base (`http://HOST:PORT`) for an engine named by its URL."""
        match = _DISCOVER.fullmatch(self.discover) if self.discover else None
        if match is None:
            return None
        scheme, host, port = match.groups()
        return f"{scheme}://{host}:{port}"

    @property
    def url_host(self) -> str | None:
        """The engine URL's host (brackets kept for IPv6): where a wildcard publisher is."""
        match = _DISCOVER.fullmatch(self.discover) if self.discover else None
        return None if match is None else match.group(2)

    def curve_client(self) -> CurveClient | None:
        """The CURVE settings of this instance's sockets, or None for plain ZMQ."""
        if self.curve is None:
            if self.client_key is not None:
                raise SpecError("client_key= needs curve=SERVER_PUBLIC_KEY")
            return None
        if not is_key(self.curve):
            raise SpecError(f"curve= must be a Z85 public key (40 characters), got {self.curve!r}")
        if self.client_key is not None and self.credential is not None:
            raise SpecError("give client_key= or credential=, not both")
        key_file, setting = self.client_key, "client_key="
        if self.credential is not None:
            try:
                key_file = registry.get(self.credential).client_key
            except CredentialError as exc:
                raise SpecError(str(exc)) from None
            if key_file is None:
                raise SpecError(f"credential {self.credential} has no client_key")
            setting = f"credential {self.credential}'s client_key"
        try:
            return CurveClient.create(self.curve, key_file)
        except KeyFileError as exc:
            if self.credential is None:
                raise SpecError(str(exc)) from None
            raise SpecError(f"{setting} can't be used: {exc}") from None

    def client_checked(self) -> InstanceSpec:
        """This spec, if an API client may give it: no file, environment variable or key
        of the host named (only a `credential=` the operator defined), no `ipc://` or
        `inproc://` endpoint; SpecError otherwise, one line that reads nothing."""
        for option in _OPERATOR_OPTIONS:
            if getattr(self, option) is not None:
                raise SpecError(
                    f"{option}= names the server's own files or variables: an API client "
                    "names a credential instead (credential=NAME, from serve's config file)"
                )
        for endpoint in self._endpoints():
            if not endpoint.startswith(_CLIENT_SCHEMES):
                raise SpecError(
                    f"endpoint {endpoint!r}: an API client gives tcp://HOST:PORT endpoints only"
                )
        try:
            for endpoint in self._endpoints():
                engine_hosts.check_endpoint(endpoint)
            for what, url in (("http=", self.http), ("metrics=", self.metrics)):
                if url is not None:
                    engine_hosts.check_url(url, what)
            if self.base_url is not None:
                engine_hosts.check_url(self.base_url, "the engine")
        except EngineHostError as exc:
            raise SpecError(str(exc)) from None
        if self.credential is not None:
            try:
                credential = registry.get(self.credential)
            except CredentialError as exc:
                raise SpecError(str(exc)) from None
            if self.discover is not None and not credential.has_api_key:
                raise SpecError(f"credential {self.credential} holds no API key")
        return self

    def hosts(self) -> list[str]:
        """Every host this spec makes kvindex connect to (ZMQ endpoints, `http=`,
        `metrics=`, an SGLang engine's URL): what an operator's spec adds to the engine
        allow-list (kvindex.security.engines)."""
        found = []
        for endpoint in self._endpoints():
            if endpoint.startswith("tcp://"):
                host = endpoint[6:].rpartition(":")[0].rpartition(";")[2]
                found.append(host.removeprefix("[").removesuffix("]"))
        for url in (self.http, self.metrics, self.base_url):
            name = urlsplit(url).hostname if url is not None else None
            if name:
                found.append(name)
        return list(dict.fromkeys(h for h in found if h and h != "*"))

    def _endpoints(self) -> list[str]:
        found = [self.endpoint, self.replay_endpoint, self.load_endpoint]
        for _, endpoint, replay in self.extra_ranks:
            found += [endpoint, replay]
        return [e for e in found if e]

    @classmethod
    def parse(cls, text: str, *, from_client: bool = False) -> InstanceSpec:
        """Parse `NAME=PUB_ENDPOINT[,replay=EP][,topic=T][,dp=N]` or
        `NAME=sglang+http://HOST:PORT[,api_key_env=VAR|,api_key_file=PATH|,credential=C]`.
        `from_client`: a spec from an API client, held to `client_checked` (and `curve=`
        the key itself, never a file) before anything is read."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise SpecError(
                f"instance spec {text!r} must look like NAME=tcp://HOST:PORT[,replay=...]"
            )
        endpoint, *options = rest.split(",")
        if EVENTS_NONE in (endpoint, *options):
            others = [o for o in (endpoint, *options) if o != EVENTS_NONE]
            none_spec = cls._parse_none(name, others, text)
            return none_spec.client_checked() if from_client else none_spec
        discovered = endpoint.startswith(DISCOVERY_SCHEMES)
        allowed = _DISCOVERY_OPTIONS if discovered else _OPTIONS
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            ranked = not discovered and _RANK_OPTION.fullmatch(key)
            if not sep or not (key in allowed or ranked):
                known = ", ".join(k + "=" for k in allowed) + ("" if discovered else ", rank@R=")
                raise SpecError(f"unknown option {option!r} in {text!r} ({known})")
            if key in fields:
                raise SpecError(f"option {key!r} given twice in {text!r}")
            fields[key] = value
        if from_client:
            _client_options(fields)
        if discovered:
            spec = cls(
                name=name,
                endpoint="",
                dp=0,
                discover=endpoint,
                api_key_env=fields.get("api_key_env"),
                api_key_file=fields.get("api_key_file"),
                model=fields.get("model") or None,
                credential=fields.get("credential") or None,
            )
            return spec.client_checked() if from_client else spec
        dp_text = fields.get("dp", "1")
        if not dp_text.isdigit():
            raise SpecError(f"dp must be a whole number, got {dp_text!r}")
        rank_text = fields.get("rank", "0")
        if not rank_text.isdigit():
            raise SpecError(f"rank must be a whole number, got {rank_text!r}")
        size_text = fields.get("block_size")
        if size_text is not None and not (size_text.isdigit() and len(size_text) < 10):
            raise SpecError(f"block_size must be a whole number, got {size_text!r}")
        if from_client:  # before any file is read (the spec's check reads client keys)
            cls._client_endpoints(endpoint, fields)
        spec = cls(
            name=name,
            endpoint=endpoint,
            replay_endpoint=fields.get("replay") or None,
            topic=fields.get("topic", ""),
            dp=int(dp_text),
            curve=_server_key(fields["curve"]) if "curve" in fields else None,
            client_key=fields.get("client_key") or None,
            model=fields.get("model") or None,
            http=fields.get("http") or None,
            metrics=fields.get("metrics") or None,
            rank=int(rank_text),
            extra_ranks=_extra_ranks(fields, text),
            load_endpoint=fields.get("load") or None,
            block_size=None if size_text is None else int(size_text),
            routing_group=fields.get("routing_group") or None,
            credential=fields.get("credential") or None,
        )
        return spec.client_checked() if from_client else spec

    @classmethod
    def _parse_none(cls, name: str, options: list[str], text: str) -> InstanceSpec:
        """`NAME=events=none[,gpu_blocks=N][,ttl=S][,model=M][,http=U][,metrics=U]...`:
        nothing of the host is named (only http(s) URLs, checked against the allow-list
        by `client_checked`)."""
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in _NONE_OPTIONS:
                known = ", ".join(k + "=" for k in _NONE_OPTIONS)
                raise SpecError(
                    f"unknown option {option!r} in {text!r} (events=none takes {known})"
                )
            if key in fields:
                raise SpecError(f"option {key!r} given twice in {text!r}")
            fields[key] = value
        numbers: dict[str, int] = {}
        for key in ("block_size", "gpu_blocks"):
            number = fields.get(key)
            if number is not None:
                if not (number.isdigit() and len(number) < 11):
                    raise SpecError(f"{key} must be a whole number, got {number!r}")
                numbers[key] = int(number)
        ttl = None
        if "ttl" in fields:
            try:
                ttl = float(fields["ttl"])
            except ValueError:
                raise SpecError(f"ttl must be a number of seconds, got {fields['ttl']!r}") from None
        return cls(
            name=name,
            endpoint="",
            load_endpoint=fields.get("load") or None,
            model=fields.get("model") or None,
            http=fields.get("http") or None,
            metrics=fields.get("metrics") or None,
            block_size=numbers.get("block_size"),
            routing_group=fields.get("routing_group") or None,
            events_none=True,
            gpu_blocks=numbers.get("gpu_blocks"),
            ttl=ttl,
        )

    @staticmethod
    def _client_endpoints(endpoint: str, fields: dict[str, str]) -> None:
        values = [endpoint, *(v for k, v in fields.items() if k in ("replay", "load"))]
        values += [v for k, v in fields.items() if "@" in k]
        for value in values:
            if value and not value.startswith(_CLIENT_SCHEMES):
                raise SpecError(
                    f"endpoint {value!r}: an API client gives tcp://HOST:PORT endpoints only"
                )

    def sources(self) -> list[SourceSpec]:
        """One publisher per DP rank (none while an engine named by its URL is pending, and
        none for an engine without events)."""
        if self.pending or self.events_none:
            return []
        curve = self.curve_client()
        if self.rank != 0 or self.extra_ranks:
            named = [(self.rank, self.endpoint, self.replay_endpoint), *self.extra_ranks]
            return [
                SourceSpec(SourceKey(self.name, rank), endpoint, replay, self.topic, curve)
                for rank, endpoint, replay in sorted(named)
            ]
        return [
            SourceSpec(
                SourceKey(self.name, rank),
                offset_endpoint(self.endpoint, rank),
                offset_endpoint(self.replay_endpoint, rank) if self.replay_endpoint else None,
                self.topic,
                curve,
            )
            for rank in range(self.dp)
        ]

    def load_sources(self) -> list[tuple[SourceKey, str]]:
        """Each DP rank's load stream endpoint (SGLang's `LoadStat` publisher), if any."""
        if self.load_endpoint is None or self.pending:
            return []
        return [
            (SourceKey(self.name, rank), offset_endpoint(self.load_endpoint, rank))
            for rank in range(self.dp)
        ]

    def _options(self, *keys: str | tuple[str, str]) -> str:
        """`,OPTION=VALUE` for each of `keys` set (a key: the option and field's name, or
        (option, field))."""
        text = ""
        for key in keys:
            option, name = (key, key) if isinstance(key, str) else key
            value = getattr(self, name)
            if value is not None:
                text += f",{option}={value}"
        return text

    def render(self) -> str:
        if self.events_none:
            none_options = ("gpu_blocks", "ttl", "model", "http", "metrics", "routing_group")
            return f"{self.name}={EVENTS_NONE}" + self._options(
                *none_options, ("load", "load_endpoint"), "block_size"
            )
        if self.discover is not None:  # the URL, never what it resolved to
            discovery = ("api_key_env", "api_key_file", "model", "credential")
            return f"{self.name}={self.discover}" + self._options(*discovery)
        text = f"{self.name}={self.endpoint}"
        if self.replay_endpoint:
            text += f",replay={self.replay_endpoint}"
        if self.topic:
            text += f",topic={self.topic}"
        if self.dp != 1:
            text += f",dp={self.dp}"
        if self.curve is not None:
            text += f",curve={self.curve}"
        if self.client_key is not None:
            text += f",client_key={self.client_key}"
        for key in ("model", "http", "metrics"):
            value = getattr(self, key)
            if value is not None:
                text += f",{key}={value}"
        if self.rank:
            text += f",rank={self.rank}"
        for rank, endpoint, replay in self.extra_ranks:
            text += f",rank@{rank}={endpoint}" + (f",replay@{rank}={replay}" if replay else "")
        if self.load_endpoint is not None:
            text += f",load={self.load_endpoint}"
        if self.routing_group is not None:
            text += f",routing_group={self.routing_group}"
        if self.block_size is not None:
            text += f",block_size={self.block_size}"
        if self.credential is not None:
            text += f",credential={self.credential}"
        return text


def _extra_ranks(fields: dict[str, str], text: str) -> tuple[tuple[int, str, str | None], ...]:
    """`rank@R=PUB` (and `replay@R=REPLAY`) options, by rank."""
    out = []
    for key, value in fields.items():
        kind, _, rank = key.partition("@")
        if kind == "rank" and rank:
            out.append((int(rank), value, fields.get(f"replay@{rank}") or None))
        elif kind == "replay" and rank and f"rank@{rank}" not in fields:
            raise SpecError(f"replay@{rank}= needs rank@{rank}= in {text!r}")
    return tuple(sorted(out))


def _client_options(fields: dict[str, str]) -> None:
    """An API client's options name nothing of the host's: refused before any is read."""
    for option in _OPERATOR_OPTIONS:
        if option in fields:
            raise SpecError(
                f"{option}= names the server's own files or variables: an API client names a "
                "credential instead (credential=NAME, from serve's config file)"
            )
    if "curve" in fields and not is_key(fields["curve"]):
        raise SpecError(
            "curve= from an API client is the server's public key itself (40 Z85 "
            "characters), never a file"
        )


def _server_key(value: str) -> str:
    """`curve=` takes the key itself or a file holding it (`kvindex keys` writes both)."""
    try:
        return read_public_key(value)
    except KeyFileError as exc:
        raise SpecError(f"curve={value}: {exc}") from None
