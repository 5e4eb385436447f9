"""Where kvindex may connect on a client's behalf: the engine host allow-list.

An API client that may add engines (the admin token) names endpoints and URLs that
kvindex then connects to, again and again: ZMQ publishers, `http=` (vLLM's `/tokenize`),
`metrics=` (scraped every few seconds), an SGLang engine's `/server_info`. `EngineHosts`
bounds them to the engines' hosts, so the API is no way to reach the rest of the network
(a cloud's metadata service, an admin port on the loopback, a database).

Entries are host names (`vllm-0.example`), `*.SUFFIX` (any name under it), IP addresses,
networks (`10.0.0.0/8`, `fd00::/8`) or `*` (any host). A name in a spec must be listed
(or under a listed suffix): names are not resolved here, so an IP-only list lets no name
through. URL schemes are listed too (`tcp`, `http`, `https` by default).

`engine_hosts` is the process's list. It starts open (`None`: a library or a test app
checks nothing); `kvindex serve` always configures it (docs/security.md): the operator's
`[security] engine_hosts` (or `--engine-hosts`), plus every host the operator configured
an engine on, plus the loopback when the API itself listens on the loopback only. Engine
discovery (Kubernetes pods, DNS names: issue 24) adds and removes the hosts it finds with
`add(host, source)` / `remove(host, source)`: a host stays allowed while any source holds
it.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_SCHEMES",
    "EngineHostError",
    "EngineHosts",
    "endpoint_host",
    "engine_hosts",
    "url_host",
]

DEFAULT_SCHEMES = ("tcp", "http", "https")
LOOPBACK = ("127.0.0.0/8", "::1", "localhost")
OPERATOR = "operator"  # the source of the hosts serve's configuration names
_NAME = re.compile(r"[a-z0-9]([a-z0-9_-]{0,62})?(\.[a-z0-9]([a-z0-9_-]{0,62})?)*")
# A client's URL: scheme, host, optional port and path; no user info, query or fragment
# (a `?` would turn the `/tokenize` kvindex appends into a query on the client's path).
_CLIENT_URL = re.compile(
    r"(?P<scheme>https?)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?"
    r"(/[A-Za-z0-9._~!$&'()*+;=:/%-]*)?"
)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class EngineHostError(ValueError):
    """A host or scheme not on the allow-list; the message says which and how to allow it."""


def endpoint_host(endpoint: str) -> tuple[str, str]:
    """(scheme, host) of a ZMQ endpoint `tcp://HOST:PORT` (an IPv6 host without its
    brackets); EngineHostError for a form a client may not give (a source address
    `tcp://SRC;HOST:PORT`, no port)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        raise EngineHostError(f"endpoint {endpoint!r}: only tcp://HOST:PORT is accepted here")
    if ";" in rest:
        raise EngineHostError(f"endpoint {endpoint!r}: a source address is not accepted here")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EngineHostError(f"endpoint {endpoint!r} needs a host and a port (tcp://HOST:PORT)")
    return scheme, host.removeprefix("[").removesuffix("]")


def url_host(url: str) -> tuple[str, str]:
    """(scheme, host) of an http(s) URL a client may give: a host, a port and a path,
    nothing else (no user info, query, fragment or backslash)."""
    match = _CLIENT_URL.fullmatch(url)
    if match is None:
        raise EngineHostError(
            f"URL {url!r}: give http(s)://HOST[:PORT][/PATH], without user info, query or fragment"
        )
    host = urlsplit(url).hostname or ""
    return match.group("scheme"), host


class EngineHosts:
    """The hosts and networks kvindex may connect to for a client (see the module
    docstring); thread-safe (discovery adds hosts from its own thread)."""

    def __init__(self, entries: Iterable[str] = (), schemes: Iterable[str] = DEFAULT_SCHEMES):
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # entry -> the sources that hold it
        self.schemes = tuple(schemes)
        for entry in entries:
            self.add(entry, OPERATOR)

    @staticmethod
    def normalise(entry: str) -> str:
        """An entry as kept and compared: a network, an address, `*`, `*.suffix` or a name
        (lowercase, no trailing dot); EngineHostError if it is none of them."""
        text = entry.strip().lower().rstrip(".")
        if text == "*":
            return text
        try:
            return str(ipaddress.ip_network(text.removeprefix("[").removesuffix("]"), strict=False))
        except ValueError:
            pass
        name = text.removeprefix("*.")
        if not _NAME.fullmatch(name) or len(name) > 253:
            raise EngineHostError(
                f"{entry!r} is not a host name, *.SUFFIX, an IP address or a network (CIDR)"
            )
        return text

    def add(self, entry: str, source: str = OPERATOR) -> None:
        """Allow a host, name suffix or network, on behalf of `source` (e.g. "discovery")."""
        key = self.normalise(entry)
        with self._lock:
            self._held.setdefault(key, set()).add(source)

    def remove(self, entry: str, source: str = OPERATOR) -> None:
        """`source` no longer holds `entry`; it stays allowed while another source does."""
        key = self.normalise(entry)
        with self._lock:
            holders = self._held.get(key)
            if holders is not None:
                holders.discard(source)
                if not holders:
                    del self._held[key]

    def entries(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def allows(self, host: str) -> bool:
        """Whether `host` (a name or an IP literal, brackets optional) is on the list."""
        host = host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
        with self._lock:
            entries = list(self._held)
        if "*" in entries:
            return True
        addresses = _addresses(host)
        for entry in entries:
            if addresses:
                if "/" in entry and any(a in ipaddress.ip_network(entry) for a in addresses):
                    return True
            elif entry == host or (entry.startswith("*.") and host.endswith(entry[1:])):
                return True
        return False

    def check(self, scheme: str, host: str, what: str) -> None:
        """Raise EngineHostError unless `scheme` and `host` are allowed."""
        if scheme not in self.schemes:
            raise EngineHostError(
                f"{what}: the scheme {scheme}:// is not allowed (engine_schemes: "
                f"{', '.join(self.schemes)})"
            )
        if not self.allows(host):
            raise EngineHostError(
                f"{what}: the host {host!r} is not an engine host kvindex may connect to "
                "(serve's --engine-hosts, [security] engine_hosts)"
            )

    def check_endpoint(self, endpoint: str, what: str = "endpoint") -> None:
        scheme, host = endpoint_host(endpoint)
        self.check(scheme, host, f"{what} {endpoint}")

    def check_url(self, url: str, what: str = "URL") -> None:
        scheme, host = url_host(url)
        self.check(scheme, host, f"{what} {url}")


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """An IP literal as itself, and an IPv4-mapped IPv6 address as its IPv4 one too; [] for
    a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return []
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return [address, address.ipv4_mapped]
    return [address]


class _Installed:
    """The process's allow-list: None (no check: a library, a test's app) until serve
    installs one."""

    def __init__(self) -> None:
        self.hosts: EngineHosts | None = None

    def install(self, hosts: EngineHosts | None) -> None:
        self.hosts = hosts

    def add(self, entry: str, source: str) -> None:
        """Allow `entry` for `source` (engine discovery: a pod's address, a DNS name it
        found); nothing to do while no list is installed (every host is allowed)."""
        if self.hosts is not None:
            self.hosts.add(entry, source)

    def remove(self, entry: str, source: str) -> None:
        """`source` no longer holds `entry` (a pod gone); see EngineHosts.remove."""
        if self.hosts is not None:
            self.hosts.remove(entry, source)

    def check_endpoint(self, endpoint: str, what: str = "endpoint") -> None:
        if self.hosts is not None:
            self.hosts.check_endpoint(endpoint, what)

    def check_url(self, url: str, what: str = "URL") -> None:
        if self.hosts is not None:
            self.hosts.check_url(url, what)

    def allows_url(self, url: str) -> bool:
        """Whether kvindex may call `url` now (the tokenizer's and the scraper's check at
        each call: a host discovery dropped is no longer called)."""
        if self.hosts is None:
            return True
        parts = urlsplit(url)
        return parts.scheme in self.hosts.schemes and self.hosts.allows(parts.hostname or "")


engine_hosts = _Installed()
