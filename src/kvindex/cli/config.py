"""`kvindex serve --config FILE.toml`: every serve option in one file (docs/configuration.md).

    [server]
    http = "0.0.0.0:8080"
    store = "sqlite:///var/lib/kvindex/kvindex.sqlite"
    token_file = "/etc/kvindex/token"        # or token_env = "NAME"; never the token itself
    metrics_token_file = "/etc/kvindex/metrics-token"   # or metrics_token_env
    admin_token_file = "/etc/kvindex/admin-token"       # or admin_token_env: fleet changes
    fleet_changes = true                      # false: no API call adds or removes instances
    tls_cert = "/etc/kvindex/tls.crt"
    tls_key = "/etc/kvindex/tls.key"
    max_body_bytes = 33554432
    max_lookup_tokens = 1000000
    max_streams = 32                          # dashboard event streams open at once
    request_timeout = 30.0
    index_shards = 2                          # default: a shard per ingest worker, up to 4
    sub_hwm = 100000                          # live messages queued per publisher
    discovery_interval = 30.0                 # seconds between /server_info reads (0: never)
    discover = ["k8s:inference?selector=app=vllm"]   # engines found (docs/discovery.md)
    dns_server = "10.0.0.10:53"               # --discover dns: asks it (default: the system's)
    allowed_hosts = ["kvindex.example.com"]   # Host names served besides localhost
    lookup_thread = true                      # plain lookups answered by a C thread

    [routing]                                 # the routing score (docs/routing.md)
    prediction_ttl = 2.0                      # seconds a /v1/route choice is predicted
    local_hashes = false                      # keep Dynamo's local hashes (/query_by_hash)
    min_engines = 2                           # /healthz 'starting' until 2 found engines live
    idle_grace = 60.0                         # KV usage 0 with blocks held: said after 60 s
    [routing.weights]                         # any of them; the rest keep their defaults
    prefix = 3.0
    cpu = 0.8

    [[instances]]
    name = "vllm-0"
    endpoint = "tcp://10.0.0.5:6557"
    replay_endpoint = "tcp://10.0.0.5:6558"   # optional
    topic = ""                                # optional, default: all topics
    dp = 1                                    # optional, DP ranks on ports +0..+dp-1
    curve = "/etc/kvindex/relay-0.key"        # optional: the relay's public key (or its file)
    client_key = "/etc/kvindex/client.key_secret"   # optional, with curve
    load = "tcp://10.0.0.5:6560"              # optional: SGLang's load stream (rank r: +r)
    model = "meta-llama/Llama-3.1-8B"         # optional: lookups naming a model see its own
    http = "http://10.0.0.5:8000"             # optional: the engine's HTTP (/tokenize, /metrics)
    metrics = "http://10.0.0.5:8000/metrics"  # optional: if not at http's /metrics

    [[instances]]
    name = "sgl-0"
    endpoint = "sglang+http://10.0.0.6:30000"  # SGLang: publishers read from /server_info
    api_key_file = "/etc/kvindex/sglang-key"  # optional (or api_key_env = "NAME")

Flags win over the file, and the file over the defaults (the token's default being
$KVINDEX_TOKEN). Secrets are never written in the file itself: it names a file or an
environment variable that holds them, so the file can live in a ConfigMap or a repository.
Every problem is a one-line usage error that names the file and the key.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvindex.cli.common import UsageError
from kvindex.security.credentials import Credential, CredentialError, registry
from kvindex.security.curve import KeyFileError, read_public_key, read_secret_key
from kvindex.security.engines import DEFAULT_SCHEMES, EngineHostError, EngineHosts
from kvindex.subscriber import InstanceSpec, SpecError
from kvindex.subscriber.spec import DISCOVERY_SCHEMES

__all__ = [
    "DEFAULT_HTTP",
    "DEFAULT_STORE",
    "MAX_DEFAULT_SHARDS",
    "ROUTING_KEYS",
    "SERVER_KEYS",
    "Settings",
    "load_settings",
    "parse_weights",
]

DEFAULT_HTTP = "127.0.0.1:8080"
DEFAULT_STORE = "sqlite:///kvindex.sqlite"  # interface.md: a file in the working directory
# The index's shards by default: one per ingest worker up to this. A lookup walks every
# shard, one after the other: measured at 64 x 100k, p50 25 us in one index, 30 at 4
# shards, 49 at 16 (docs/performance.md), so more shards than this cost lookups more than
# a node's ingest gains.
MAX_DEFAULT_SHARDS = 4
INSTANCE_KEYS = {
    "name",
    "endpoint",
    "replay_endpoint",
    "topic",
    "dp",
    "curve",
    "client_key",
    "spec",
    "load",
    "api_key_env",
    "api_key_file",
    "model",
    "http",
    "metrics",
    "credential",
}
# [credentials.NAME]: the secrets API clients refer to by name (kvindex.security.credentials)
CREDENTIAL_KEYS = {"api_key_file", "api_key_env", "client_key"}
# [server] keys beside http and store: what `HttpOptions` takes (see cli/httpopts.py).
_SECRET_KEYS = {
    "token_file",
    "token_env",
    "metrics_token_file",
    "metrics_token_env",
    "admin_token_file",
    "admin_token_env",
}
_BOOL_KEYS = {"fleet_changes"}
_PATH_KEYS = {"tls_cert", "tls_key"}
_INT_KEYS = {
    "max_body_bytes",
    "max_lookup_tokens",
    "max_streams",
    "max_header_bytes",
    "max_connections",
}
_FLOAT_KEYS = {"request_timeout", "header_timeout", "tls_handshake_timeout"}
_LIST_KEYS = {"allowed_hosts"}
SERVER_KEYS = (
    {
        "http",
        "store",
        "ingest_workers",
        "index_shards",
        "sub_hwm",
        "discovery_interval",
        "tokenizer",
        "tokenizer_cache_mb",
        "discover",
        "dns_server",
        "lookup_thread",
    }
    | _SECRET_KEYS
    | _PATH_KEYS
    | _INT_KEYS
    | _FLOAT_KEYS
    | _LIST_KEYS
    | _BOOL_KEYS
)

# [security]: where kvindex may connect for a client (kvindex.security.engines)
SECURITY_KEYS = {"engine_hosts", "engine_schemes"}

# [routing]: the score's weights, predictions, Dynamo's local hashes (the peers' /query_by_hash)
ROUTING_KEYS = {"weights", "prediction_ttl", "local_hashes", "min_engines", "idle_grace"}


@dataclass(slots=True)
class Settings:
    """What to serve: flags layered over the config file."""

    instances: list[InstanceSpec] = field(default_factory=list)
    http: str = DEFAULT_HTTP
    store: str = DEFAULT_STORE
    # The file's HTTP security and limit settings, resolved (secrets read): the values
    # `http_options` uses where no flag was given. Keys: token, metrics_token, tls_cert,
    # tls_key, max_body_bytes, max_lookup_tokens, request_timeout, allowed_hosts.
    http_options: dict[str, Any] = field(default_factory=dict)
    ingest_workers: int | None = None  # None: one per core (kvindex.runtime.ingest)
    index_shards: int | None = None  # None: serve's default_shards; 1: one index; N: N shards
    sub_hwm: int | None = None  # None: the Subscriber's default (100,000)
    # Seconds between two reads of a well SGLang engine's /server_info (None: 30 s; 0: never)
    discovery_interval: float | None = None
    # `MODEL=PATH|vllm`: how each model's prompts become token ids (lookups by text)
    tokenizers: list[str] = field(default_factory=list)
    tokenizer_cache_mb: float | None = None  # each local tokenizer's prefix cache (None: 64)
    # The routing score's weights by name (`kvindex.runtime.routing.Weights.of`), checked;
    # the ones not given keep their defaults.
    weights: dict[str, float] = field(default_factory=dict)
    prediction_ttl: float | None = None  # None: the router's default (2 s)
    # Keep Dynamo's local block hashes in the compiled index (the peers' /query_by_hash)
    local_hashes: bool = False
    # The operator's named secrets ([credentials.NAME]), which specs refer to by name
    credentials: list[Credential] = field(default_factory=list)
    # Engine hosts an API client's specs may name (None: serve's default, docs/security.md)
    engine_hosts: list[str] | None = None
    engine_schemes: list[str] | None = None  # None: tcp, http, https
    # `k8s:...` / `dns:...`: engines found rather than named (kvindex.runtime.finders)
    discover: list[str] = field(default_factory=list)
    dns_server: str | None = None  # IP[:PORT] asked for dns: (None: $KVINDEX_DNS_SERVER)
    min_engines: int | None = None  # /healthz 'starting' until that many found engines live
    idle_grace: float | None = None  # seconds of KV usage 0 with blocks before it is said
    # Plain lookups answered by a C thread on the listening socket (kvindex.service.lookupd)
    lookup_thread: bool = True


def load_settings(args: argparse.Namespace) -> Settings:
    """The config file (if any), then the flags; every problem is a UsageError."""
    settings = read_config(args.config) if args.config is not None else Settings()
    for text in args.instance:
        settings.instances.append(_parse_spec(text))
    if args.http is not None:
        settings.http = args.http
    if args.store is not None:
        settings.store = args.store
    if getattr(args, "ingest_workers", None) is not None:
        settings.ingest_workers = args.ingest_workers
    if getattr(args, "index_shards", None) is not None:
        settings.index_shards = args.index_shards
    if getattr(args, "sub_hwm", None) is not None:
        settings.sub_hwm = args.sub_hwm
    if getattr(args, "discovery_interval", None) is not None:
        settings.discovery_interval = args.discovery_interval
    settings.tokenizers += getattr(args, "tokenizer", None) or []
    if getattr(args, "tokenizer_cache_mb", None) is not None:
        settings.tokenizer_cache_mb = args.tokenizer_cache_mb
    for given in getattr(args, "weights", None) or []:
        settings.weights.update(given)
    if getattr(args, "prediction_ttl", None) is not None:
        settings.prediction_ttl = args.prediction_ttl
    if getattr(args, "local_hashes", False):
        settings.local_hashes = True
    if getattr(args, "engine_hosts", None) is not None:
        settings.engine_hosts = check_engine_hosts(args.engine_hosts, "--engine-hosts")
    settings.discover += getattr(args, "discover", None) or []
    if getattr(args, "min_engines", None) is not None:
        settings.min_engines = args.min_engines
    if getattr(args, "idle_grace", None) is not None:
        settings.idle_grace = args.idle_grace
    if getattr(args, "lookup_thread", None) is not None:
        settings.lookup_thread = args.lookup_thread == "on"
    names = [spec.name for spec in settings.instances]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(f"instance {duplicates[0]!r} is given twice")
    return settings


def _parse_spec(text: str) -> InstanceSpec:
    try:
        return InstanceSpec.parse(text)
    except SpecError as exc:
        raise UsageError(str(exc)) from None


def read_config(path: Path) -> Settings:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"can't read {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"server", "instances", "routing", "store", "credentials", "security"}
    if unknown:
        raise UsageError(
            f"{path}: unknown key {sorted(unknown)[0]!r} (server, instances, routing, "
            "credentials, security)"
        )
    server = _table(data.get("server", {}), f"{path}: [server]", SERVER_KEYS)
    settings = Settings()
    settings.credentials = _credentials(data.get("credentials", {}), path)
    _security(data.get("security", {}), path, settings)
    # Defined before any instance is read: a spec's credential= must name one of them.
    registry.replace(settings.credentials)
    settings.http = _string(server.get("http", DEFAULT_HTTP), f"{path}: server.http")
    store = server.get("store", data.get("store", DEFAULT_STORE))
    settings.store = _string(store, f"{path}: store")
    settings.http_options = _http_options(server, path)
    if "ingest_workers" in server:
        workers = server["ingest_workers"]
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 256:
            raise UsageError(f"{path}: server.ingest_workers must be a whole number, 1 to 256")
        settings.ingest_workers = workers
    if "index_shards" in server:
        shards = server["index_shards"]
        if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= 256:
            raise UsageError(f"{path}: server.index_shards must be a whole number, 1 to 256")
        settings.index_shards = shards
    if "sub_hwm" in server:
        hwm = server["sub_hwm"]
        if not isinstance(hwm, int) or isinstance(hwm, bool) or hwm < 1:
            raise UsageError(f"{path}: server.sub_hwm must be a whole number of at least 1")
        settings.sub_hwm = hwm
    if "discovery_interval" in server:
        seconds = server["discovery_interval"]
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not 0 <= seconds < float("inf")
        ):
            raise UsageError(
                f"{path}: server.discovery_interval must be a number of seconds (0: never)"
            )
        settings.discovery_interval = float(seconds)
    if "lookup_thread" in server:
        if not isinstance(server["lookup_thread"], bool):
            raise UsageError(f"{path}: server.lookup_thread must be true or false")
        settings.lookup_thread = server["lookup_thread"]
    if "tokenizer" in server:
        listed = server["tokenizer"]
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            raise UsageError(f'{path}: server.tokenizer must be a list of "MODEL=PATH|vllm"')
        settings.tokenizers = list(listed)
    if "tokenizer_cache_mb" in server:
        mb = server["tokenizer_cache_mb"]
        if not isinstance(mb, int | float) or isinstance(mb, bool) or not 0 <= mb < 1 << 20:
            raise UsageError(f"{path}: server.tokenizer_cache_mb must be a number of MiB (0: off)")
        settings.tokenizer_cache_mb = float(mb)
    if "discover" in server:
        listed = server["discover"]
        if not isinstance(listed, list) or not all(isinstance(t, str) and t for t in listed):
            raise UsageError(f'{path}: server.discover must be a list of "k8s:..." or "dns:..."')
        settings.discover = list(listed)
    if "dns_server" in server:
        settings.dns_server = _string(server["dns_server"], f"{path}: server.dns_server")
    _routing(data.get("routing", {}), path, settings)
    instances = data.get("instances", [])
    if not isinstance(instances, list):
        raise UsageError(f"{path}: 'instances' must be an array of tables ([[instances]])")
    for i, entry in enumerate(instances):
        where = f"{path}: instances[{i}]"
        settings.instances.append(_config_instance(_table(entry, where, INSTANCE_KEYS), where))
    return settings


def _routing(table: object, path: Path, settings: Settings) -> None:
    """`[routing]`: `prediction_ttl` and the `weights` table, each value checked."""
    routing = _table(table, f"{path}: [routing]", ROUTING_KEYS)
    if "prediction_ttl" in routing:
        ttl = routing["prediction_ttl"]
        if not _number(ttl) or not 0 < ttl < float("inf"):
            raise UsageError(f"{path}: routing.prediction_ttl must be a positive number of seconds")
        settings.prediction_ttl = float(ttl)
    if "idle_grace" in routing:
        grace = routing["idle_grace"]
        if not _number(grace) or not 0 < grace < float("inf"):
            raise UsageError(f"{path}: routing.idle_grace must be a positive number of seconds")
        settings.idle_grace = float(grace)
    if "min_engines" in routing:
        count = routing["min_engines"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UsageError(f"{path}: routing.min_engines must be a whole number (0: no gate)")
        settings.min_engines = count
    if "local_hashes" in routing:
        if not isinstance(routing["local_hashes"], bool):
            raise UsageError(f"{path}: routing.local_hashes must be true or false")
        settings.local_hashes = routing["local_hashes"]
    if "weights" in routing:
        weights = routing["weights"]
        where = f"{path}: routing.weights"
        if not isinstance(weights, dict):
            raise UsageError(f"{where} must be a table (NAME = number)")
        for name, value in weights.items():
            if not _number(value):
                raise UsageError(f"{where}.{name} must be a number, got {value!r}")
        try:
            settings.weights = _checked_weights(weights)
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}") from None


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _checked_weights(values: dict[str, Any]) -> dict[str, float]:
    """The weights as floats, if the router takes them (ValueError says why not)."""
    from kvindex.runtime.routing import Weights  # not on `kvindex --help`'s path

    weights = {name: float(value) for name, value in values.items()}
    Weights.of(weights)
    return weights


def parse_weights(text: str) -> dict[str, float]:
    """`--weights NAME=VALUE[,NAME=VALUE...]`, checked (argparse's one-line error)."""
    values: dict[str, Any] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            values[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"{part!r} must be NAME=NUMBER, e.g. queue=1.5")
    try:
        return _checked_weights(values)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _http_options(server: dict[str, Any], path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("token", "metrics_token", "admin_token"):
        file_key, env_key = f"{name}_file", f"{name}_env"
        if file_key in server and env_key in server:
            raise UsageError(f"{path}: give server.{file_key} or server.{env_key}, not both")
        if file_key in server:
            out[name] = _secret_file(_string(server[file_key], f"{path}: server.{file_key}"))
        elif env_key in server:
            env = _string(server[env_key], f"{path}: server.{env_key}")
            if env not in os.environ:
                raise UsageError(f"{path}: server.{env_key}: ${env} is not set")
            out[name] = os.environ[env]
    for key in _PATH_KEYS & set(server):
        out[key] = _string(server[key], f"{path}: server.{key}")
    for key in _INT_KEYS & set(server):
        value = server[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{path}: server.{key} must be a whole number of at least 1")
        out[key] = value
    for key in _LIST_KEYS & set(server):
        value = server[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise UsageError(f"{path}: server.{key} must be an array of host names")
        out[key] = list(value)
    for key in _BOOL_KEYS & set(server):
        if not isinstance(server[key], bool):
            raise UsageError(f"{path}: server.{key} must be true or false")
        out[key] = server[key]
    for key in _FLOAT_KEYS & set(server):
        value = server[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise UsageError(f"{path}: server.{key} must be a positive number of seconds")
        out[key] = float(value)
    return out


def _secret_file(path: str) -> str:
    """A secret kept in a file (a Kubernetes Secret mounted as one, systemd's credentials):
    its content without the line end that editors and `echo` add."""
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise UsageError(f"can't read the token file {path}: {reason}") from None


def _table(value: object, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a table")
    unknown = set(value) - keys
    if unknown:
        raise UsageError(f"{where}: unknown key {sorted(unknown)[0]!r} ({', '.join(sorted(keys))})")
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where} must be a string")
    return value


def _config_instance(entry: dict[str, Any], where: str) -> InstanceSpec:
    try:
        if "spec" in entry:
            if len(entry) > 1:
                raise SpecError("give either 'spec' or the fields, not both")
            return InstanceSpec.parse(_string(entry["spec"], f"{where}.spec"))
        for key in ("name", "endpoint"):
            if key not in entry:
                raise SpecError(f"'{key}' is required")
        endpoint = _string(entry["endpoint"], f"{where}.endpoint")
        if endpoint.startswith(DISCOVERY_SCHEMES):
            return _discovered_instance(entry, endpoint, where)
        if "api_key_env" in entry or "api_key_file" in entry:
            raise SpecError("api_key_env and api_key_file go with endpoint = 'sglang+http://...'")
        dp = entry.get("dp", 1)
        if not isinstance(dp, int) or isinstance(dp, bool):
            raise SpecError("'dp' must be a whole number")
        replay = entry.get("replay_endpoint")
        curve = entry.get("curve")
        client_key = entry.get("client_key")
        load = entry.get("load")
        return InstanceSpec(
            name=_string(entry["name"], f"{where}.name"),
            endpoint=endpoint,
            replay_endpoint=None if replay is None else _string(replay, f"{where}.replay_endpoint"),
            topic=_string(entry.get("topic", ""), f"{where}.topic"),
            dp=dp,
            curve=None if curve is None else _server_key(_string(curve, f"{where}.curve")),
            client_key=None if client_key is None else _string(client_key, f"{where}.client_key"),
            load_endpoint=None if load is None else _string(load, f"{where}.load"),
            model=_optional(entry, "model", where),
            http=_optional(entry, "http", where),
            metrics=_optional(entry, "metrics", where),
            credential=_known_credential(entry, where),
        )
    except SpecError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _security(table: object, path: Path, settings: Settings) -> None:
    """`[security]`: `engine_hosts` (names, *.SUFFIX, addresses, networks, "*") and
    `engine_schemes` (of tcp, http, https)."""
    security = _table(table, f"{path}: [security]", SECURITY_KEYS)
    for key in SECURITY_KEYS & set(security):
        value = security[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise UsageError(f"{path}: security.{key} must be an array of strings")
    if "engine_hosts" in security:
        settings.engine_hosts = check_engine_hosts(security["engine_hosts"], f"{path}: security")
    if "engine_schemes" in security:
        schemes = security["engine_schemes"]
        unknown = sorted(set(schemes) - set(DEFAULT_SCHEMES))
        if unknown:
            raise UsageError(
                f"{path}: security.engine_schemes: {unknown[0]!r} is not one of "
                f"{', '.join(DEFAULT_SCHEMES)}"
            )
        settings.engine_schemes = list(schemes)


def check_engine_hosts(entries: list[str], where: str) -> list[str]:
    """Engine host entries, each checked (a UsageError names the first bad one)."""
    try:
        return [EngineHosts.normalise(entry) for entry in entries]
    except EngineHostError as exc:
        raise UsageError(f"{where}.engine_hosts: {exc}") from None


def _credentials(table: object, path: Path) -> list[Credential]:
    """`[credentials.NAME]` tables: each an API key (file or variable) and/or a CURVE
    client key file; checked now (a file that can't be read is a usage error at start)."""
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [credentials] must hold tables ([credentials.NAME])")
    found = []
    for name, entry in table.items():
        where = f"{path}: credentials.{name}"
        fields = _table(entry, where, CREDENTIAL_KEYS)
        values = {key: _string(value, f"{where}.{key}") for key, value in fields.items()}
        try:
            credential = Credential(name, **values)
            credential.api_key()  # readable, one printable line (never shown)
            if credential.client_key is not None:
                read_secret_key(credential.client_key)
        except (CredentialError, KeyFileError) as exc:
            raise UsageError(f"{where}: {exc}") from None
        found.append(credential)
    return found


def _optional(entry: dict[str, Any], key: str, where: str) -> str | None:
    value = entry.get(key)
    return None if value is None else _string(value, f"{where}.{key}")


def _known_credential(entry: dict[str, Any], where: str) -> str | None:
    name = _optional(entry, "credential", where)
    if name is not None and name not in registry.names():
        raise SpecError(f"credential {name!r} is not defined ([credentials.{name}])")
    return name


def _discovered_instance(entry: dict[str, Any], url: str, where: str) -> InstanceSpec:
    """An SGLang engine named by its URL: its publishers come from its /server_info, so
    only the API key's source may be given beside it."""
    allowed = {"name", "endpoint", "api_key_env", "api_key_file", "model", "credential"}
    given = set(entry) - allowed
    if given:
        raise SpecError(
            f"'{sorted(given)[0]}' does not go with an SGLang URL (its /server_info says it)"
        )
    key_env, key_file = entry.get("api_key_env"), entry.get("api_key_file")
    spec = f"{_string(entry['name'], f'{where}.name')}={url}"
    if key_env is not None:
        spec += f",api_key_env={_string(key_env, f'{where}.api_key_env')}"
    if key_file is not None:
        spec += f",api_key_file={_string(key_file, f'{where}.api_key_file')}"
    if "model" in entry:
        spec += f",model={_string(entry['model'], f'{where}.model')}"
    credential = _known_credential(entry, where)
    if credential is not None:
        spec += f",credential={credential}"
    return InstanceSpec.parse(spec)


def _server_key(value: str) -> str:
    """The key itself, or a file holding it, as `curve=` takes it in a spec."""
    try:
        return read_public_key(value)
    except KeyFileError as exc:
        raise SpecError(f"curve={value}: {exc}") from None
