"""`--discover dns:HOST[:PORT][?options]`: engines behind a DNS name (a headless Service, VMs).

Every `interval` seconds the name is resolved again: SRV records where the name has them
(each target's addresses, on the record's port), else its A and AAAA records on PORT
(default 5557). Each address is an engine named `HOST@IP:PORT` (`/` would split the
instance's URL path in the API), HOST being the SRV record's target where there is one
(it names the engine: `vllm-0.example@10.0.0.5:5557`), else the name asked. The answer
replaces the last one: an address that left it is removed with its blocks. An answer that
says the name does not exist (NXDOMAIN) or has no addresses empties the set; a server that
does not answer (timeout, SERVFAIL) changes nothing (the engines stay followed; their own
links say whether they are alive).

Options: `replay=PORT|none` (default: the events port + 1, 5558 beside 5557), `topic=T`,
`dp=N`, `model=NAME`, `http=PORT` (the engine's HTTP server: /metrics and /tokenize).
The system resolver is asked unless `KVINDEX_DNS_SERVER=IP:PORT` (or the config file's
`dns_server`) names another server.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import dns.exception
import dns.rdatatype
import dns.resolver

from kvindex.runtime.finders.common import EngineOptions, FinderThread, tcp
from kvindex.runtime.finders.reconcile import Found, FoundBy, Reconciler

__all__ = ["DEFAULT_PORT", "DnsFinder", "DnsTarget", "dns_server", "parse_dns"]

DEFAULT_PORT = 5557
DNS_SERVER_ENV = "KVINDEX_DNS_SERVER"
_OPTIONS = {"replay", "topic", "dp", "model", "http"}


@dataclass(frozen=True, slots=True)
class DnsTarget:
    source: str  # the --discover text
    host: str
    port: int
    replay: str  # "auto" (port + 1), "none", or a port
    options: EngineOptions

    def replay_port(self, port: int) -> int | None:
        if self.replay == "none":
            return None
        return port + 1 if self.replay == "auto" else int(self.replay)


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{what} must be a port (1-65535), got {text!r}")
    return int(text)


def parse_dns(text: str) -> DnsTarget:
    """`dns:HOST[:PORT][?replay=PORT|none&topic=T&dp=N&model=M&http=PORT]` (ValueError)."""
    body, _, query = text.removeprefix("dns:").partition("?")
    host, sep, port_text = body.rpartition(":")
    if not sep:
        host, port_text = body, str(DEFAULT_PORT)
    host = host.rstrip(".")
    if not host or any(not part for part in host.split(".")) or "/" in host:
        raise ValueError(f"--discover {text!r} must be dns:HOST[:PORT][?options]")
    port = _port(port_text, f"--discover {text!r}: the port")
    fields: dict[str, str] = {}
    for key, values in parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        if key not in _OPTIONS:
            raise ValueError(
                f"--discover {text!r}: unknown option {key!r} ({', '.join(sorted(_OPTIONS))})"
            )
        fields[key] = values[-1]
    replay = fields.get("replay", "auto")
    if replay not in ("auto", "none"):
        _port(replay, f"--discover {text!r}: replay")
    dp = fields.get("dp", "1")
    if not dp.isdigit() or not 1 <= int(dp) <= 256:
        raise ValueError(f"--discover {text!r}: dp must be 1 to 256, got {dp!r}")
    http = fields.get("http")
    options = EngineOptions(
        replay_port=None,
        topic=fields.get("topic", ""),
        dp=int(dp),
        model=fields.get("model") or None,
        http_port=None if http is None else _port(http, f"--discover {text!r}: http"),
    )
    return DnsTarget(text, host, port, replay, options)


def dns_server(text: str | None = None) -> tuple[str, int] | None:
    """The server to ask: `text`, else $KVINDEX_DNS_SERVER (`IP:PORT` or `IP`), else None
    (the system resolver). ValueError if malformed."""
    text = text if text is not None else os.environ.get(DNS_SERVER_ENV) or None
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or (":" in host and not host.startswith("[")):
        host, port = text, "53"
    host = host.strip("[]")
    return host, _port(port, f"DNS server {text!r}")


class DnsFinder(FinderThread):
    """Resolves one target every `interval` seconds and hands the answer to `reconciler`."""

    def __init__(
        self,
        target: DnsTarget,
        reconciler: Reconciler,
        *,
        interval: float = 10.0,
        server: tuple[str, int] | None = None,
        timeout: float = 2.0,
    ) -> None:
        super().__init__(f"discover {target.source}")
        self.target = target
        self.reconciler = reconciler
        self.interval = interval
        self.resolver = dns.resolver.Resolver(configure=server is None)
        if server is not None:
            self.resolver.nameservers = [server[0]]
            self.resolver.port = server[1]
        self.resolver.lifetime = timeout
        self.resolver.cache = None  # every round asks: the answer is what changes
        self.rounds = 0  # resolutions applied (tests wait on it)

    def step(self) -> None:
        found = self.resolve()
        self.reconciler.replace(self.target.source, found, f"gone from {self.target.host}'s answer")
        self.rounds += 1
        self.wait(self.interval)

    def resolve(self) -> dict[str, Found]:
        """The engines the name points at now (raises on a server that does not answer)."""
        target = self.target
        srv = self._query(target.host, "SRV")
        pairs: list[tuple[str, str, int]] = []  # (name asked, ip, port)
        if srv:
            for record in srv:
                name = str(record.target).rstrip(".")
                pairs += [(name, ip, int(record.port)) for ip in self._addresses(name)]
        else:
            pairs = [(target.host, ip, target.port) for ip in self._addresses(target.host)]
        found: dict[str, Found] = {}
        for asked, ip, port in sorted(set(pairs)):
            name = f"{asked}@{tcp(ip, port)}"
            spec = target.options.spec(name, ip, port, target.replay_port(port))
            found[name] = Found(spec, FoundBy("dns", target.source, tcp(ip, port), dns_name=asked))
        return found

    def _addresses(self, name: str) -> list[str]:
        return [str(r.address) for kind in ("A", "AAAA") for r in self._query(name, kind)]

    def _query(self, name: str, kind: str) -> Iterable[Any]:
        try:
            return list(self.resolver.resolve(name, kind, search=False))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # authoritative: nothing there

    def describe(self, exc: Exception) -> str:
        if isinstance(exc, dns.exception.Timeout):
            return f"no answer from the DNS server for {self.target.host} (engines kept)"
        if isinstance(exc, dns.resolver.NoNameservers):
            return f"the DNS servers failed for {self.target.host} (engines kept)"
        return super().describe(exc)
