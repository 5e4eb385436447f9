"""Engines found rather than named: Kubernetes pods (`k8s:`) and DNS names (`dns:`).

`--discover` values become finder threads (`finder_of`: `k8sfind`, `dnsfind`) that hand
their whole answer to one `Reconciler`, which adds, replaces and removes instances of the
`Fleet` through its public methods. See docs/discovery.md.
"""

from __future__ import annotations

from kvindex.runtime.finders.common import FinderThread
from kvindex.runtime.finders.reconcile import FleetChange, Found, FoundBy, Reconciler

__all__ = ["FinderThread", "FleetChange", "Found", "FoundBy", "Reconciler", "finder_of"]

SCHEMES = ("k8s:", "dns:")


def finder_of(
    text: str, reconciler: Reconciler, *, interval: float, dns_server: str | None = None
) -> FinderThread:
    """The finder a `--discover` value names (ValueError says what is wrong with it)."""
    if text.startswith("dns:"):
        from kvindex.runtime.finders.dnsfind import DnsFinder, parse_dns
        from kvindex.runtime.finders.dnsfind import dns_server as server_of

        return DnsFinder(
            parse_dns(text), reconciler, interval=interval, server=server_of(dns_server)
        )
    if text.startswith("k8s:"):
        from kvindex.runtime.finders.k8sfind import K8sFinder, parse_k8s

        return K8sFinder(parse_k8s(text), reconciler)
    raise ValueError(f"--discover {text!r} must start with k8s: or dns:")
