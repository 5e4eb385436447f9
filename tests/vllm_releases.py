"""vLLM's own KV-event classes and ZMQ publisher, release by release, without vLLM.

Tests use this module to check kvindex against the code that produces the wire format
rather than against our reading of it. For each release we fetch only
``vllm/distributed/kv_events.py`` (and ``vllm/config/kv_events.py`` where it exists)
out of the wheel on PyPI with HTTP range requests (about 0.6 s, instead of downloading
300+ MB), cache them, and execute them as an isolated module with small stubs standing
in for the rest of vLLM.

Schema generations covered by ``RELEASES`` (each claim checked against the sources):
array-form events up to 0.23.x, map-form from 0.24.0; replay replies with 3 frames up
to 0.25.x and 4 frames (topic added) from 0.26.0.

Publisher endpoints: every release *binds* its PUB socket only for endpoints containing
``*`` or ``::`` (or ipc/inproc) and *connects* it otherwise. Binding ``tcp://*:PORT``
would open the port on all interfaces, so ``start_publisher`` binds the PUB socket to
the given loopback endpoint itself (before the release's own ``_socket_setup``, which
then leaves PUB alone and sets up the replay ROUTER as usual). Pass
``force_bind=False`` to keep the release's bind-or-connect choice untouched.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import ipaddress
import logging
import os
import re
import shutil
import socket
import sys
import threading
import types
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

# One release per schema generation; the comment says what that release introduced.
# Checked against the sources of every release 0.9.0 - 0.33.0 (all 43 load). lora_id
# (and later medium, lora_name) stay required constructor fields in every release.
# Not listed: 0.31.0 (first import of vllm.utils.network_utils: "tcp://*:0" binds an
# ephemeral port on the node IP, here 127.0.0.1; no wire change).
RELEASES: list[str] = [
    "0.9.0",  # first release with KV events: [ts, events], no dp rank; BlockStored 6
    "0.9.1",  # EventBatch gains data_parallel_rank: [ts, events, dp_rank]
    "0.10.2",  # medium on BlockStored (7) and BlockRemoved; hashes become bytes | int
    "0.14.0",  # lora_name (BlockStored 8)
    "0.17.0",  # extra_keys (BlockStored 9)
    "0.20.0",  # group_idx on both (BlockStored 10, BlockRemoved 4)
    "0.22.0",  # kv_cache_spec_kind, kv_cache_spec_sliding_window (BlockStored 12)
    "0.23.0",  # last array-form events
    "0.24.0",  # first map-form events {"type": ..., field: ...}
    "0.25.0",  # last release whose replay reply is [b"", seq, payload]
    "0.26.0",  # replay reply [b"", topic, seq, payload]; locality on both events
    "0.29.0",  # ownership on both events
    "0.30.0",  # session_id on BlockStored
    "0.33.0",  # lookahead_token_ids on BlockStored; replay SNDHWM 2 * (buffer_steps + 1)
]

SIMPLE_INDEX_URL = "https://pypi.org/simple/vllm/"
KV_EVENTS_MEMBER = "vllm/distributed/kv_events.py"
CONFIG_MEMBER = "vllm/config/kv_events.py"
HTTP_TIMEOUT_S = 20.0
_MAX_MEMBER_BYTES = 4 << 20  # a guard: these files are ~20 KB

# Values for fields a release *requires* but a test did not pass (constructor args with
# no default). Everything else keeps the release's own default.
_STORED_DEFAULTS: dict[str, Any] = {
    "block_hashes": [101, 102],
    "parent_block_hash": None,
    "token_ids": list(range(32)),
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
_REMOVED_DEFAULTS: dict[str, Any] = {"block_hashes": [101], "medium": "GPU"}


class ReleaseUnavailable(RuntimeError):
    """The release's sources are neither cached nor obtainable from PyPI."""


# --------------------------------------------------------------------------- fetching


def cache_root() -> Path:
    """``$KVINDEX_TEST_CACHE`` or ``~/.cache/kvindex-tests``."""
    env = os.environ.get("KVINDEX_TEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvindex-tests"


def fetch_source(version: str) -> Path:
    """Directory holding ``kv_events.py`` (+ ``config_kv_events.py`` if the release has
    one) for ``version``; fetched from PyPI once, then served from the cache."""
    target = cache_root() / "kv_events" / version
    if (target / "kv_events.py").is_file():
        return target
    members = _read_wheel_members(wheel_url(version), [KV_EVENTS_MEMBER, CONFIG_MEMBER])
    if KV_EVENTS_MEMBER not in members:
        raise ReleaseUnavailable(f"vllm {version} has no {KV_EVENTS_MEMBER}")
    _store_atomically(target, members)
    return target


def _store_atomically(target: Path, members: dict[str, bytes]) -> None:
    # Write into a private directory and rename it into place, so a crash or a
    # concurrent test run never leaves a half-written cache entry behind.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "kv_events.py").write_bytes(members[KV_EVENTS_MEMBER])
    if CONFIG_MEMBER in members:
        (tmp / "config_kv_events.py").write_bytes(members[CONFIG_MEMBER])
    try:
        tmp.rename(target)
    except OSError:  # another process won the race: its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


# The index page, or the error that fetching it raised: remembered for the process so
# that with PyPI unreachable every later release skips at once instead of timing out.
_INDEX: dict[str, str | ReleaseUnavailable] = {}


def _simple_index() -> str:
    if SIMPLE_INDEX_URL not in _INDEX:
        try:
            _INDEX[SIMPLE_INDEX_URL] = _http_get(SIMPLE_INDEX_URL).decode("utf-8")
        except ReleaseUnavailable as exc:
            _INDEX[SIMPLE_INDEX_URL] = exc
    cached = _INDEX[SIMPLE_INDEX_URL]
    if isinstance(cached, ReleaseUnavailable):
        raise ReleaseUnavailable(str(cached))
    return cached


def wheel_url(version: str) -> str:
    """URL of a wheel of ``vllm==version``, preferring manylinux x86_64 without a build
    tag (every platform wheel carries the same Python files)."""
    candidates = []
    for href in re.findall(r'href="([^"]+)"', _simple_index()):
        url = href.split("#", 1)[0]
        name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        parts = name.removesuffix(".whl").split("-")
        if name.endswith(".whl") and len(parts) in (5, 6) and parts[1] == version:
            rank = ("x86_64" not in parts[-1], "manylinux" not in parts[-1], len(parts))
            candidates.append((rank, url))
    if not candidates:
        raise ReleaseUnavailable(f"no wheel of vllm=={version} listed on {SIMPLE_INDEX_URL}")
    return min(candidates)[1]


def _http_get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> bytes:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            if "Range" in (headers or {}) and response.status != 206:
                # A server ignoring Range would send the whole 300 MB wheel.
                raise ReleaseUnavailable(f"{url}: range request answered {response.status}")
            if method == "HEAD":
                return response.headers.get("Content-Length", "").encode()
            return bytes(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ReleaseUnavailable(f"cannot fetch {url}: {exc}") from exc


class _HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests, enough for ``zipfile``."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self._url = url
        self._pos = 0
        length = _http_get(url, method="HEAD")
        if not length.isdigit():
            raise ReleaseUnavailable(f"{url}: no Content-Length")
        self._size = int(length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        if end <= self._pos:
            return 0
        data = _http_get(self._url, headers={"Range": f"bytes={self._pos}-{end - 1}"})
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _read_wheel_members(url: str, names: Iterable[str]) -> dict[str, bytes]:
    """The wanted files of a remote wheel (zip), reading only the bytes zipfile needs:
    the end record, the central directory and the members themselves."""
    raw = _HttpRangeFile(url)
    found = {}
    try:
        # A 1 MiB buffer turns zipfile's many small reads into a few range requests.
        with zipfile.ZipFile(io.BufferedReader(raw, 1 << 20)) as wheel:
            present = set(wheel.namelist())
            for name in names:
                if name in present:
                    if wheel.getinfo(name).file_size > _MAX_MEMBER_BYTES:
                        raise ReleaseUnavailable(f"{url}: {name} is unexpectedly large")
                    found[name] = wheel.read(name)
    except zipfile.BadZipFile as exc:  # in practice: a transfer cut short
        raise ReleaseUnavailable(f"{url}: unreadable wheel: {exc}") from exc
    return found


# ------------------------------------------------------------------------------ stubs


def _init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def _config_decorator(cls: type) -> type:
    # vllm.config.utils.config: from 0.17 it also makes the class a (pydantic)
    # dataclass; a stdlib dataclass has the same fields, defaults and __post_init__.
    return cls if dataclasses.is_dataclass(cls) else dataclasses.dataclass(cls)


def _pydantic_field(default: Any = None, **_: Any) -> Any:
    return dataclasses.field(default=default)


def _pydantic_dataclass(cls: type | None = None, **kwargs: Any) -> Any:
    return dataclasses.dataclass(**kwargs) if cls is None else dataclasses.dataclass(cls)


@dataclasses.dataclass
class _KVEventsConfig09:
    """KVEventsConfig of 0.9.x, which lived in the monolithic vllm/config.py (the same
    fields as the later vllm/config/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _get_ip() -> str:
    # The real get_ip() asks the OS for this node's address; tests want loopback, so
    # 0.33's "tcp://*:0" (bind an ephemeral port on the node IP) stays on 127.0.0.1.
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def _is_valid_ipv6_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def _get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if _is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    parsed = urllib.parse.urlparse(path)
    return parsed.scheme, parsed.hostname or "", str(parsed.port or "")


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []  # makes "import name.sub" look for sys.modules entries
    module.__dict__.update(attrs)
    return module


def _stub_modules() -> dict[str, types.ModuleType]:
    """Every module a kv_events.py of 0.9.0 - 0.33.0 imports from vLLM (+ pydantic, for
    the config file). Fresh objects per load, so releases never share a stub."""
    stubs = [
        _module("vllm", package=True),
        _module("vllm.config", package=True, KVEventsConfig=_KVEventsConfig09),
        _module("vllm.config.utils", config=_config_decorator),
        _module("vllm.logger", init_logger=_init_logger),
        _module("vllm.v1", package=True),
        _module("vllm.v1.core", package=True),
        _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int),
        _module("vllm.utils", package=True),
        _module(
            "vllm.utils.network_utils",
            get_ip=_get_ip,
            get_tcp_uri=_get_tcp_uri,
            is_valid_ipv6_address=_is_valid_ipv6_address,
            split_zmq_path=_split_zmq_path,
        ),
        # pydantic only validates the config; stubbing it keeps tests free of it and
        # identical whether or not pydantic is installed.
        _module("pydantic", package=True, Field=_pydantic_field),
        _module("pydantic.dataclasses", dataclass=_pydantic_dataclass),
    ]
    by_name = {module.__name__: module for module in stubs}
    for name, module in by_name.items():  # parent.child attributes, as import does
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(by_name[parent], child, module)
    return by_name


STUBBED_IMPORTS = frozenset(_stub_modules())


def vllm_imports(source: str) -> set[str]:
    """Modules a source file imports from vLLM (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "vllm" or name.startswith("vllm.")}


# ---------------------------------------------------------------------------- loading

_LOAD_LOCK = threading.Lock()
_LOADED: dict[str, types.ModuleType] = {}


@contextlib.contextmanager
def _temporary_modules(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    """Install ``modules`` in sys.modules, then restore exactly what was there (a real
    vLLM or pydantic included) and drop any vllm.* module imported meanwhile."""
    before = dict(sys.modules)
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in list(sys.modules):
            if name in modules or name == "vllm" or name.startswith("vllm."):
                if name in before:
                    sys.modules[name] = before[name]
                else:
                    del sys.modules[name]


def _exec_module(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    # Registered before execution so dataclasses/msgspec can find the module globals.
    sys.modules[name] = module
    try:
        exec(compile(path.read_text("utf-8"), str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_release(version: str, *, reload: bool = False) -> types.ModuleType:
    """vLLM ``version``'s ``vllm.distributed.kv_events`` as a module of its own
    (``vllm_release_0_33_0``), loaded once per process unless ``reload``.

    The module also carries ``VLLM_VERSION`` and ``VLLM_IMPORTS`` (what it imports from
    vLLM, all stubbed). The stubs live in sys.modules only while the file executes.
    Raises ReleaseUnavailable when the sources are not cached and PyPI is unreachable.
    """
    with _LOAD_LOCK:
        if reload or version not in _LOADED:
            _LOADED[version] = _load_uncached(version)
        return _LOADED[version]


def _load_uncached(version: str) -> types.ModuleType:
    source_dir = fetch_source(version)
    config_path = source_dir / "config_kv_events.py"
    imports = vllm_imports((source_dir / "kv_events.py").read_text("utf-8"))
    provided = STUBBED_IMPORTS | ({"vllm.config.kv_events"} if config_path.is_file() else set())
    if imports - provided:
        missing = sorted(imports - provided)
        raise ImportError(f"vllm {version} kv_events.py imports unstubbed {missing}")
    base = f"vllm_release_{version.replace('.', '_')}"
    stubs = _stub_modules()
    with _temporary_modules(stubs):
        if config_path.is_file():
            # The real config module, importable under vLLM's name while we load.
            config = _exec_module(f"{base}_config", config_path)
            stubs["vllm.config"].kv_events = config
            stubs["vllm.config"].KVEventsConfig = config.KVEventsConfig
            sys.modules["vllm.config.kv_events"] = config
        module = _exec_module(base, source_dir / "kv_events.py")
    module.VLLM_VERSION = version
    module.VLLM_IMPORTS = frozenset(imports)
    return module


# ------------------------------------------------------------------- building events


def field_names(struct_type: type) -> tuple[str, ...]:
    """The fields of one of the release's msgspec structs, in wire order."""
    return tuple(field.name for field in msgspec.structs.fields(struct_type))


def _build(struct_type: type, defaults: dict[str, Any], fields: dict[str, Any]) -> Any:
    # Fields the release does not know are dropped, so one test body serves every
    # release; required ones the caller left out get a neutral value.
    known = msgspec.structs.fields(struct_type)
    values = {f.name: fields[f.name] for f in known if f.name in fields}
    for field in known:
        if field.required and field.name not in values:
            if field.name not in defaults:
                raise TypeError(f"{struct_type.__name__}.{field.name} is required")
            values[field.name] = defaults[field.name]
    return struct_type(**values)


def make_stored(mod: types.ModuleType, **fields: Any) -> Any:
    """``mod.BlockStored`` with the given fields that this release knows."""
    return _build(mod.BlockStored, _STORED_DEFAULTS, fields)


def make_removed(mod: types.ModuleType, **fields: Any) -> Any:
    """``mod.BlockRemoved`` with the given fields that this release knows."""
    return _build(mod.BlockRemoved, _REMOVED_DEFAULTS, fields)


def make_cleared(mod: types.ModuleType) -> Any:
    return mod.AllBlocksCleared()


def has_dp_rank(mod: types.ModuleType) -> bool:
    return "data_parallel_rank" in field_names(mod.KVEventBatch)


def make_batch(
    mod: types.ModuleType, ts: float, events: Iterable[Any], dp_rank: int | None = None
) -> Any:
    """``mod.KVEventBatch``. On the wire the dp rank is never None from 0.9.1 on: the
    publisher's publish() fills in its own rank; pass ``dp_rank=0`` to mirror that."""
    if not has_dp_rank(mod):
        if dp_rank is not None:
            raise ValueError(f"vllm {mod.VLLM_VERSION} batches carry no data_parallel_rank")
        return mod.KVEventBatch(ts=ts, events=list(events))
    return mod.KVEventBatch(ts=ts, events=list(events), data_parallel_rank=dp_rank)


def encode_batch(mod: types.ModuleType, batch: Any) -> bytes:
    """The payload frame, encoded as the release's publisher thread does."""
    del mod  # same encoder in every release; kept for a uniform call shape
    return msgspec.msgpack.Encoder().encode(batch)


# ------------------------------------------------------------------------- publisher


def _would_connect(endpoint: str) -> bool:
    # Every release's heuristic: bind for "*", "::", ipc:// and inproc://, else connect.
    bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return not bind


def _binding_socket_setup(real_setup: Callable[[Any], None]) -> Callable[[Any], None]:
    def _socket_setup(self: Any) -> None:
        # Runs inside the release's __init__, after any dp-rank port offset. Creating
        # the PUB socket first makes the real _socket_setup (whose PUB branch starts
        # with "if self._pub is None") keep it and only set up the replay ROUTER.
        if self._pub is None and self._endpoint and _would_connect(self._endpoint):
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            self._pub.bind(self._endpoint)
        real_setup(self)

    return _socket_setup


def start_publisher(
    mod: types.ModuleType,
    pub_endpoint: str,
    replay_endpoint: str | None = None,
    buffer_steps: int = 10_000,
    topic: str = "",
    *,
    data_parallel_rank: int = 0,
    force_bind: bool = True,
    **kwargs: Any,
) -> Any:
    """The release's real ``ZmqEventPublisher``, running (call ``.shutdown()``).

    With ``force_bind`` (default) a tcp PUB endpoint the release would connect, e.g.
    ``tcp://127.0.0.1:PORT``, is bound instead; the rest is the release's own code.
    ``data_parallel_rank`` (0.9.1+) shifts both ports by the rank, as vLLM does.
    ``kwargs`` go to the constructor (``hwm``, ``max_queue_size``).
    """
    cls = mod.ZmqEventPublisher
    if force_bind:
        namespace = {"_socket_setup": _binding_socket_setup(cls._socket_setup)}
        cls = type(f"Bound{cls.__name__}", (cls,), namespace)
    args = dict(
        endpoint=pub_endpoint,
        replay_endpoint=replay_endpoint,
        buffer_steps=buffer_steps,
        topic=topic,
        **kwargs,
    )
    if "data_parallel_rank" in inspect.signature(mod.ZmqEventPublisher).parameters:
        args["data_parallel_rank"] = data_parallel_rank
    elif data_parallel_rank:
        raise ValueError(f"vllm {mod.VLLM_VERSION}'s publisher has no data parallel rank")
    return cls(**args)


@contextlib.contextmanager
def running_publisher(mod: types.ModuleType, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """``start_publisher`` as a context manager that shuts the publisher down."""
    publisher = start_publisher(mod, *args, **kwargs)
    try:
        yield publisher
    finally:
        publisher.shutdown()


def free_tcp_endpoint() -> str:
    """``tcp://127.0.0.1:PORT`` with a port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
